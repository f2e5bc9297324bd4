"""mnemo: sequence models as associative memories."""

__version__ = "0.1.0"
