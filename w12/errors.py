"""Exceptions raised by the W12 format, its codec and its file I/O."""

from __future__ import annotations

__all__ = ["W12Error", "W12FormatError", "W12VerificationError", "W12CorruptFileError", "W12CheckpointError"]


class W12Error(Exception):
    """Base class of every W12 error."""


class W12FormatError(W12Error, ValueError):
    """A packed weight (or its metadata) does not follow docs/w12-format.md."""


class W12VerificationError(W12Error, RuntimeError):
    """`pack(..., verify=True)` decoded the planes and did not get the input back bit for bit."""


class W12CorruptFileError(W12FormatError):
    """A W12 safetensors file is truncated, has bad metadata, or fails a checksum."""


class W12CheckpointError(W12Error, ValueError):
    """A checkpoint cannot be packed or loaded into a model: the input is not a well-formed safetensors
    file, the output cannot be written, or the file's tensors do not match the model's (missing,
    unexpected, wrong shape or dtype)."""
