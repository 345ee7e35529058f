"""A helper module of the package: shipped in the same archive as ``shiplib.stats``."""


def line(mean: float, spread: float) -> str:
    return f"mean {mean:.2f}, spread {spread:.2f}"
