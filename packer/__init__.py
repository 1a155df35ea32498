"""ExpertDesk packer: reads a source GGUF (single file or split set) and builds Expert Packs. No Qt."""
