"""logitcache.cache_format: the on-disk cache of teacher top-k logprobs (Zarr v3).

The names below are the package's face: ``server/`` and ``client/`` import these, not the
modules behind them. The normative byte-level spec is ``FORMAT.md`` beside this file.
Importing this package does not import torch.

- reading and writing: :class:`CacheReader`, :class:`CacheWriter`, :class:`IndexSnapshot`,
  :func:`validate`, :func:`kernels_in_use` (which compiled kernels run);
- records and their wire form: :class:`SequenceRecord`, :class:`SequenceBatch` (many sequences as
  flat columns, the writer's fastest input), :class:`RowBlock`, :class:`TopkRows`,
  :func:`encode_records` / :func:`decode_records`;
- the manifest and the teacher identity: :class:`Manifest`, :data:`TEACHER_FIELDS`,
  :func:`teacher_diff`, :func:`tokenizer_fingerprint`;
- stores: :func:`open_store`, :func:`read_root_attrs`, :func:`parse_root`, :func:`store_stats`,
  :func:`resealed_root_attrs` (root attributes edited for serving, digest recomputed);
- the :class:`FormatError` family (also in :mod:`.errors`).
"""

from ._encode import encode_record
from ._fingerprint import tokenizer_fingerprint
from ._info import kernels_in_use
from ._manifest import IDENTITY_FIELDS, Manifest
from ._reader import CacheReader
from ._seqbatch import SequenceBatch
from ._snapshot import IndexSnapshot
from ._validate import Problem, ValidationReport, validate
from ._wire import (
    CONTENT_TYPE,
    FrameDecoder,
    decode_records,
    encode_records,
    exact_frame_dtype,
    iter_decode,
)
from ._writer import CacheWriter
from .errors import (
    ChecksumError,
    CorruptStoreError,
    FormatError,
    ManifestError,
    ManifestMismatchError,
    MissingDataError,
    PlacementError,
    RecordError,
    StoreNeedsRepairError,
    StoreNotFoundError,
    TargetKindError,
    UnsupportedVersionError,
    WireFormatError,
    WriterLockedError,
)
from .hidden import HiddenRecord, HiddenRows, TeacherHead
from .identity import (
    TEACHER_EXTRA_FIELDS,
    TEACHER_EXTRA_KEY,
    TEACHER_FIELDS,
    teacher_diff,
    teacher_extra,
    teacher_of,
)
from .layout import INCOMPLETE_ATTR, parse_root, read_root_attrs, resealed_root_attrs
from .quant import decode_logprobs, encode_logprobs
from .records import (
    RowBlock,
    SequenceRecord,
    TopkRows,
    check_record,
    computed_tail,
    content_key,
    known_tail,
    rows_array,
    tail_from_logprobs,
)
from .spec import FORMAT_VERSION, ROOT_ATTR, Layout, layout_named
from .stats import store_stats, tail_summary
from .store import delete_prefix, get_object, list_children, object_exists, object_size, open_store

__all__ = [
    "CONTENT_TYPE",
    "FORMAT_VERSION",
    "IDENTITY_FIELDS",
    "INCOMPLETE_ATTR",
    "ROOT_ATTR",
    "TEACHER_EXTRA_FIELDS",
    "TEACHER_EXTRA_KEY",
    "TEACHER_FIELDS",
    "CacheReader",
    "CacheWriter",
    "ChecksumError",
    "CorruptStoreError",
    "FormatError",
    "FrameDecoder",
    "HiddenRecord",
    "HiddenRows",
    "IndexSnapshot",
    "Layout",
    "Manifest",
    "ManifestError",
    "ManifestMismatchError",
    "MissingDataError",
    "PlacementError",
    "Problem",
    "RecordError",
    "RowBlock",
    "SequenceBatch",
    "SequenceRecord",
    "StoreNeedsRepairError",
    "StoreNotFoundError",
    "TargetKindError",
    "TeacherHead",
    "TopkRows",
    "UnsupportedVersionError",
    "ValidationReport",
    "WireFormatError",
    "WriterLockedError",
    "check_record",
    "computed_tail",
    "content_key",
    "decode_logprobs",
    "decode_records",
    "delete_prefix",
    "encode_logprobs",
    "encode_record",
    "encode_records",
    "exact_frame_dtype",
    "get_object",
    "iter_decode",
    "kernels_in_use",
    "known_tail",
    "layout_named",
    "list_children",
    "object_exists",
    "object_size",
    "open_store",
    "parse_root",
    "read_root_attrs",
    "resealed_root_attrs",
    "rows_array",
    "store_stats",
    "tail_from_logprobs",
    "tail_summary",
    "teacher_diff",
    "teacher_extra",
    "teacher_of",
    "tokenizer_fingerprint",
    "validate",
]
