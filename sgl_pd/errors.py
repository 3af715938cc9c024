"""The root of every error sgl_pd raises, so callers can catch the package's errors at once."""


class SglPdError(Exception):
    """Base class of all sgl_pd errors. Messages say what went wrong and what to do."""


class ConfigError(SglPdError):
    """A user-supplied setting is invalid; the message names the flag and the accepted values."""
