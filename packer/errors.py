"""The packer's own error: a pack that could not be built. (A pack that cannot be used is
`expertpack.PackError`, part of the format.)"""


class PackBuildError(RuntimeError):
    """A pack could not be built (or rebuilt). The message says what, why and what to do."""
