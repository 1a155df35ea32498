"""Qt user interface. Imported only when a window is opened."""
