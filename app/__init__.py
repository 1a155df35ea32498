"""ExpertDesk application layer: the Qt window, the setup wizard and the command line.

Only this package may import Qt; `engine` and `packer` stay headless.
"""

__version__ = "0.1.0"
