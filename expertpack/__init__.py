"""The Expert Pack on-disk format (docs/expert-pack-format.md), and nothing else.

The one package both sides of a pack import: `packer` writes and verifies packs,
`engine` reads them. It depends on the standard library only, never on `app`,
`engine` or `packer` (pyproject.toml's import-linter contracts hold it to that).

Modules:
    layout    file names, format name/version, alignment, block geometry
              (`align_up`, `role_offsets`, `experts_geometry`), the experts.bin
              header (`experts_file_header`, `check_experts_file_header`) and the
              dense file's samples (`dense_sample_ranges`, `dense_sample_digest`)
    manifest  the manifest schema (`PackManifest`, `LayerEntry`, `RoleEntry`,
              `SourceFile`): JSON (de)serialisation, validation, the layout digest and
              slice keys (`PackManifest.layout_sha256`, `slice_digest`), `config_sha256`
    files     `load_manifest`, `write_manifest` (atomic), `sha256_file`, `fsync_dir`,
              safe opening (`open_pack_file`, `pack_file_problem`, `check_same_file`)
    check     `check_pack`: the quick check of every load; `dense_sample_sha256`
    errors    `PackError`, a pack that cannot be used

Every public name is importable from the package itself: `from expertpack import PackManifest`.
"""

from expertpack.check import check_pack, dense_sample_sha256, verify_hint
from expertpack.errors import PackError
from expertpack.files import (
    check_pack_file,
    check_same_file,
    fsync_dir,
    load_manifest,
    open_pack_file,
    pack_file_problem,
    sha256_file,
    write_manifest,
)
from expertpack.layout import (
    ALIGNMENT,
    DENSE_NAME,
    DENSE_SAMPLE_BYTES,
    DENSE_SAMPLES,
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
    dense_sample_digest,
    dense_sample_ranges,
    experts_file_header,
    experts_geometry,
    role_offsets,
)
from expertpack.manifest import (
    LayerEntry,
    PackManifest,
    RoleEntry,
    SourceFile,
    config_sha256,
    expert_tensor_name,
)

__all__ = [
    "ALIGNMENT",
    "DENSE_NAME",
    "DENSE_SAMPLES",
    "DENSE_SAMPLE_BYTES",
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
    "check_pack",
    "check_pack_file",
    "check_same_file",
    "config_sha256",
    "dense_sample_digest",
    "dense_sample_ranges",
    "dense_sample_sha256",
    "expert_tensor_name",
    "experts_file_header",
    "experts_geometry",
    "fsync_dir",
    "load_manifest",
    "open_pack_file",
    "pack_file_problem",
    "role_offsets",
    "sha256_file",
    "verify_hint",
    "write_manifest",
]
