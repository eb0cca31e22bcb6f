"""The one exception type analysis raises for bad input, with a one-line message meant for the user."""


class AnalysisError(ValueError):
    """Bad or insufficient input (missing column, too few points, unknown table...)."""
