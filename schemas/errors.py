"""Exceptions with a message that says what, where and the fix. The CLI maps them to exit code 2."""


class RollflowError(Exception):
    """Base class: an error a user can fix (bad input, bad config). Not a bug in rollflow."""


class ConfigError(RollflowError):
    """A config value breaks a rule. Message: the field, the rule, the reason, the fix."""


class SchemaError(RollflowError):
    """A table lacks a column, has a wrong type, or a file cannot be read as Parquet."""


class InvariantError(RollflowError):
    """A table has the right schema but its values break an invariant (NaN, incomplete group, mask length)."""
