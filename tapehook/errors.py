"""The one exception type tapehook raises for misuse."""


class TapehookError(ValueError):
    """Bad input to tapehook: the message names the problem and the fix."""
