"""The Expert Pack on-disk format (docs/expert-pack-format.md), and nothing else.

The one package both sides of a pack import: `packer` writes and verifies packs,
`engine` reads them. It depends on the standard library only, never on `app`,
`engine` or `packer` (pyproject.toml's import-linter contracts hold it to that).

Modules:
    layout    file names, format name/version, alignment, block geometry
              (`align_up`, `role_offsets`, `experts_geometry`) and the experts.bin
              header (`experts_file_header`, `check_experts_file_header`)
    manifest  the manifest schema (`PackManifest`, `LayerEntry`, `RoleEntry`,
              `SourceFile`): JSON (de)serialisation, validation, `config_sha256`
    files     `load_manifest`, `write_manifest` (atomic), `sha256_file`, `fsync_dir`
    errors    `PackError`, a pack that cannot be used

Every public name is importable from the package itself: `from expertpack import PackManifest`.
"""

from expertpack.errors import PackError
from expertpack.files import fsync_dir, load_manifest, sha256_file, write_manifest
from expertpack.layout import (
    ALIGNMENT,
    DENSE_NAME,
    DIGEST_SIZE,
    EXPERTS_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    HASHES_NAME,
    HEADER_MAGIC,
    HEADER_SIZE,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    align_up,
    check_experts_file_header,
    experts_file_header,
    experts_geometry,
    role_offsets,
)
from expertpack.manifest import LayerEntry, PackManifest, RoleEntry, SourceFile, config_sha256

__all__ = [
    "ALIGNMENT",
    "DENSE_NAME",
    "DIGEST_SIZE",
    "EXPERTS_NAME",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASHES_NAME",
    "HEADER_MAGIC",
    "HEADER_SIZE",
    "MANIFEST_NAME",
    "PARTIAL_SUFFIX",
    "LayerEntry",
    "PackError",
    "PackManifest",
    "RoleEntry",
    "SourceFile",
    "align_up",
    "check_experts_file_header",
    "config_sha256",
    "experts_file_header",
    "experts_geometry",
    "fsync_dir",
    "load_manifest",
    "role_offsets",
    "sha256_file",
    "write_manifest",
]
