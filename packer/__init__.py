"""ExpertDesk packer: reads a source GGUF (single file or split set) and builds Expert Packs. No Qt.

The pack format itself (manifest, layout, header) is the `expertpack` package, shared
with the engine; this package writes and verifies packs in that format.
"""
