"""Write a copy of a GGUF with its quantized weights in another block format, for benchmarks that
ask how a peer does on a format its fast kernels cover (llama.cpp's batched tinyBLAS path has Q8_0
and Q4_0, not the default model's Q4_1).

    .venv/bin/python bench/requantize.py [--model PATH] --type Q8_0 OUT.gguf

Each quantized tensor is dequantized to fp32 with the gguf package and quantized again to --type
(gguf's reference quantizers: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); fp32/fp16/bf16 tensors (the norms) and
all metadata are copied as they are, but `general.file_type` (set to the new format's). Q4_1 -> Q8_0 keeps each weight within
half a step (its block's largest magnitude / 127) plus the step's own fp16 rounding (up to 127 x
2^-11 of a step); the copy is another model, so its outputs are compared with each other, not with
the original's. A file with no quantized tensor is refused (there is nothing to requantize).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


class RequantizeError(Exception):
    """The source cannot be requantized; the message is one sentence."""


def requantize(src: Path, dst: Path, qtype_name: str) -> dict[str, int]:
    import gguf
    from gguf.quants import dequantize, quantize

    target = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    dense = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    if all(gguf.GGMLQuantizationType(t.tensor_type) in dense for t in reader.tensors):
        raise RequantizeError(f"{src.name} has no quantized tensor to requantize")
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        if field.name == "general.file_type":
            continue  # written below, for the new format
        if field.name == "general.alignment":  # the writer pads tensors to it, not only records it
            writer.add_custom_alignment(int(field.contents()))
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(FILE_TYPES[qtype_name])
    counts: dict[str, int] = {}
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype in dense:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=qtype)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
            continue
        try:
            values = dequantize(np.asarray(t.data), qtype)  # (rows, cols) fp32
        except NotImplementedError:
            raise RequantizeError(f"tensor {t.name!r} is {qtype.name}, which the gguf package cannot dequantize") from None
        writer.add_tensor(t.name, quantize(values.astype(np.float32), target), raw_dtype=target)
        counts[f"{qtype.name} -> {qtype_name}"] = counts.get(f"{qtype.name} -> {qtype_name}", 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None, help="source GGUF (default: the default model)")
    p.add_argument("--type", default="Q8_0", choices=sorted(FILE_TYPES))
    args = p.parse_args()
    from isolab.models.locate import resolve_model_path

    src = resolve_model_path(args.model)
    if args.out.resolve() == src.resolve():
        print(f"error: {args.out} is the source file; write the copy elsewhere", file=sys.stderr)
        return 2
    try:
        counts = requantize(src, args.out, args.type)
    except RequantizeError as exc:
        args.out.unlink(missing_ok=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB) from {src.name}: "
          + ", ".join(f"{n} x {k}" for k, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
