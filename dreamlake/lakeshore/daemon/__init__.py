"""The in-sandbox side of a remote invocation: ``entry`` is what every runner starts."""
