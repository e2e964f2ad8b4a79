#!/usr/bin/env python3
"""make_bad_files.py — writes the handcrafted corpus of malformed safetensors containers into
tests/data/bad/, one small file per failure class of formats/SPEC.md §1. Every file must be
rejected by kvst_open with KVCAP_ERR_FORMAT and a message naming the file and the field;
tests/test_safetensors.c holds the table of expected message substrings (keep the two in step).

Python 3 standard library only (struct + json). The .safetensors outputs are committed; this
script is kept for provenance and to regenerate them:  python3 tests/data/make_bad_files.py

Container layout (SPEC §1): u64 little-endian header length N, N bytes of JSON header (padded
with spaces), then the data buffer. Headers are written as raw text where a class needs
something json.dumps cannot produce (a repeated key, trailing garbage, invalid UTF-8).

Classes (file name: what is wrong). All but five are invalid for the reference implementation
too; bad_rank, empty_name, json_nul_escape, long_name and unknown_dtype break only kvcap's
stricter rules (SPEC §1) — tests/interop.py checks that split against PyPI safetensors.
  truncated                    file of 5 bytes, shorter than the length field
  truncated_empty              file of 0 bytes
  header_past_eof              N larger than the rest of the file
  bad_header_length_huge       N = 2^40, above the 100 000 000-byte limit
  bad_header_length_small      N = 1, too small to hold a JSON object
  bad_json                     header is not valid JSON (cut off mid-object)
  bad_utf8                     header holds a byte sequence that is not UTF-8
  header_not_object            header is a JSON array
  header_trailing              garbage after the JSON object (only spaces may follow)
  header_nul_padding           header padded with NUL bytes instead of spaces
  json_nul_escape              a tensor name containing \\u0000
  tensor_not_object            a tensor entry that is a number, not an object
  missing_dtype                a tensor without "dtype"
  duplicate_field              a tensor with "dtype" twice
  unknown_dtype                dtype "I64" (valid safetensors, not a kvcap dtype)
  unknown_dtype_lowercase      dtype "f32" (names are case-sensitive)
  bad_shape_negative           shape [-2]
  bad_shape_fraction           shape [1.5]
  bad_shape_string             shape ["2"]
  bad_shape_huge               shape [2^60] (beyond what a JSON number holds exactly)
  bad_rank                     shape of rank 9
  shape_overflow               shape [2^52, 4096]: 2^64 elements
  shape_bytes_overflow         shape [2^31, 2^31] x F64: 2^65 bytes
  bad_data_offsets             data_offsets with one element
  bad_data_offsets_fraction    data_offsets [0, 8.5]
  begin_after_end              data_offsets [8, 0]
  offset_out_of_range          data_offsets end past the data buffer
  size_mismatch                [0, 12] for shape [4] x F16 (needs 8)
  overlap                      two ranges overlapping
  hole                         a gap between two ranges
  hole_at_start                the first range starts after 0
  trailing_data                bytes after the last range
  duplicate_name               the same tensor key twice
  empty_name                   tensor key ""
  long_name                    tensor key of 256 bytes
  bad_metadata                 __metadata__ value that is a number
  bad_metadata_not_object      __metadata__ that is a string
  duplicate_metadata           two __metadata__ keys
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bad")


def container(header, data=b"", pad=True, length=None):
    """Bytes of a container: `header` is a dict (dumped compactly) or raw str/bytes."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8")
    if pad:
        header += b" " * ((-(8 + len(header))) % 8)
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def t(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


F8 = bytes(range(8))  # 8 bytes of data, enough for the F32 [2] tensor most classes use
GOOD = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'

FILES = {
    "truncated": b"\x10\x00\x00\x00\x00",
    "truncated_empty": b"",
    "header_past_eof": container({"a": t()}, F8, length=1000),
    "bad_header_length_huge": container({"a": t()}, F8, length=1 << 40),
    "bad_header_length_small": container("{", b"", pad=False, length=1),
    "bad_json": container('{"a":{"dtype":"F32","shape":[2],', F8),
    "bad_utf8": container(b'{"a\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', F8),
    "header_not_object": container("[1,2]", b""),
    "header_trailing": container("{" + GOOD + "} x", F8),
    "header_nul_padding": container(("{" + GOOD + "}").encode() + b"\0\0\0\0", F8, pad=False),
    "json_nul_escape": container('{"a\\u0000b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
                                 F8),
    "tensor_not_object": container({"a": 5}),
    "missing_dtype": container({"a": {"shape": [2], "data_offsets": [0, 8]}}, F8),
    "duplicate_field": container('{"a":{"dtype":"F32","dtype":"F32","shape":[2],'
                                 '"data_offsets":[0,8]}}', F8),
    "unknown_dtype": container({"a": t(dtype="I64", shape=(1,))}, F8),
    "unknown_dtype_lowercase": container({"a": t(dtype="f32")}, F8),
    "bad_shape_negative": container({"a": t(shape=(-2,))}, F8),
    "bad_shape_fraction": container({"a": t(shape=(1.5,))}, F8),
    "bad_shape_string": container({"a": t(shape=("2",))}, F8),
    "bad_shape_huge": container({"a": t(shape=(1 << 60,))}, F8),
    "bad_rank": container({"a": t(shape=(1,) * 9, offsets=(0, 4))}, F8[:4]),
    "shape_overflow": container({"a": t(shape=(1 << 52, 4096))}, F8),
    "shape_bytes_overflow": container({"a": t(dtype="F64", shape=(1 << 31, 1 << 31))}, F8),
    "bad_data_offsets": container({"a": t(offsets=(0,))}, F8),
    "bad_data_offsets_fraction": container({"a": t(offsets=(0, 8.5))}, F8),
    "begin_after_end": container({"a": t(offsets=(8, 0))}, F8),
    "offset_out_of_range": container({"a": t()}, F8[:4]),
    "size_mismatch": container({"a.b": t(dtype="F16", shape=(4,), offsets=(0, 12))}, bytes(12)),
    "overlap": container({"a": t(), "b": t(offsets=(4, 12))}, bytes(12)),
    "hole": container({"a": t(), "b": t(offsets=(12, 20))}, bytes(20)),
    "hole_at_start": container({"a": t(offsets=(4, 12))}, bytes(12)),
    "trailing_data": container({"a": t()}, bytes(12)),
    "duplicate_name": container("{" + GOOD + ',"a":{"dtype":"F32","shape":[2],'
                                '"data_offsets":[8,16]}}', bytes(16)),
    "empty_name": container({"": t()}, F8),
    "long_name": container({"n" * 256: t()}, F8),
    "bad_metadata": container({"__metadata__": {"k": 1}, "a": t()}, F8),
    "bad_metadata_not_object": container({"__metadata__": "x", "a": t()}, F8),
    "duplicate_metadata": container('{"__metadata__":{"k":"v"},"__metadata__":{"k":"w"},'
                                    + GOOD + "}", F8),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, blob in sorted(FILES.items()):
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(blob)
    print(f"wrote {len(FILES)} files to {OUT}")


if __name__ == "__main__":
    main()
