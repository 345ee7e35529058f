"""``python -m nymph``: the same as the ``nymph`` console script."""

from nymph.cli import main

if __name__ == "__main__":
    main()
