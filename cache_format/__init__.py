"""logitcache.cache_format: the on-disk cache of teacher top-k logprobs (Zarr v3).

Public API (DESIGN.md): :class:`Manifest`, :class:`SequenceRecord`, :class:`RowBlock`,
:class:`CacheWriter`, :class:`CacheReader`, :func:`validate`, :func:`tokenizer_fingerprint`,
:func:`encode_records` / :func:`decode_records`, :func:`kernels_in_use`, and the
:class:`FormatError` family.
The normative byte-level spec is ``FORMAT.md`` beside this file. Importing this package does not
import torch.
"""

from ._info import kernels_in_use
from .errors import (
    CorruptStoreError,
    FormatError,
    ManifestError,
    ManifestMismatchError,
    MissingDataError,
    RecordError,
    StoreNotFoundError,
    UnsupportedVersionError,
    WireFormatError,
    WriterLockedError,
)
from .fingerprint import tokenizer_fingerprint
from .manifest import IDENTITY_FIELDS, Manifest
from .reader import CacheReader
from .records import RowBlock, SequenceRecord, check_record, content_key, tail_from_logprobs
from .spec import FORMAT_VERSION, Layout
from .validate import Problem, ValidationReport, validate
from .wire import CONTENT_TYPE, FrameDecoder, decode_records, encode_records, iter_decode
from .writer import CacheWriter

__all__ = [
    "CONTENT_TYPE",
    "FORMAT_VERSION",
    "IDENTITY_FIELDS",
    "CacheReader",
    "CacheWriter",
    "CorruptStoreError",
    "FormatError",
    "FrameDecoder",
    "Layout",
    "Manifest",
    "ManifestError",
    "ManifestMismatchError",
    "MissingDataError",
    "Problem",
    "RecordError",
    "RowBlock",
    "SequenceRecord",
    "StoreNotFoundError",
    "UnsupportedVersionError",
    "ValidationReport",
    "WireFormatError",
    "WriterLockedError",
    "check_record",
    "content_key",
    "decode_records",
    "encode_records",
    "iter_decode",
    "kernels_in_use",
    "tail_from_logprobs",
    "tokenizer_fingerprint",
    "validate",
]
