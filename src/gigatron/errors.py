"""The one exception type that carries a user-facing message."""


class GigatronError(Exception):
    """Bad input from the user: the message names the input and says how to fix it.

    The command line prints the message alone (no stack trace) and exits with status 2.
    """
