"""Static facts of the Triton kernels for a Hopper GPU, compiled here without one.

Triton compiles a kernel ahead of time for a target (sm_90: H100 / H200) on any machine:
its own ptxas and nvdisasm ship with it. This reports, per kernel and configuration:

- quant_gemv's `_gemv_kernel` (the dense decode GEMV, also the body of the K-quant expert
  kernels: `row_dots`): the SASS instructions of its main loop, per weight value each thread
  decodes (the loop walks BLOCK_N rows x SB units of 256 values per step, over 32 x
  num_warps threads), and how many of them are warp shuffles (SHFL), barriers (BAR) and
  shared-memory moves (LDS/STS). The K-quant GEMV is instruction-bound on an H200 (24-29% of
  the copy rate, benchmarks/results/quant-gemv-vm-20261202-144304.json), so fewer
  instructions per value is what speeds it up; the timing itself needs the GPU
  (bench_quant_gemv.py).
- moe_quant's `_down_kernel` (a decode step's routed K-quant experts) the same way: its
  rows are walked by the same `row_dots`.
- moe_mxfp4's `_gate_up_kernel` and `_down_kernel` (a decode step's routed MXFP4 experts,
  DeepSeek-V4-Flash's d_in 4096 / inter 2048) the same way, per value a thread decodes.
- moe_mxfp4_prefill's two kernels (a prompt chunk's routed MXFP4 experts) at their default
  tiles and at 8 warps, with BLOCK_M 16 (a 512-token chunk of DeepSeek-V4) and 64 (4,096
  tokens): the same loop statistics and the whole kernel's register spills (LDL / STL).
- decode_attention's `_split_kernel`: the shared memory it asks for at DeepSeek-V4's
  512-feature tiles, per dtype and software-pipelining stages, with the indexer's picks
  (CSA layers) and without (HCA and sliding-window layers), against the 232,448 bytes a
  Hopper block may have (above it the launch fails and the model falls back to torch).

It needs Triton (the GPU machine has it; here: a venv with `pip install triton`), not a GPU.

    python benchmarks/kernel_sass.py [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402

HOPPER_SHARED_BYTES = 232_448  # the most shared memory one block may use on sm_90
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)")


def compiled(fn, signature: dict[str, str], constants: dict[str, object], aligned: tuple[str, ...] = (),
             **options):
    """`fn` (a @triton.jit function) compiled for sm_90: the CompiledKernel. `aligned` names the
    arguments to take as multiples of 16 (pointers: 16-byte aligned), as Triton's launcher
    specializes them when they are at launch: what decides whether loads are vectorized."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    constants = {k: v for k, v in constants.items() if k in params}  # an older kernel (a "before" run) may lack one
    types = {p: ("constexpr" if p in constants else signature[p]) for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in aligned}
    source = ASTSource(fn=fn, signature=types, constexprs={(params.index(k),): v for k, v in constants.items()},
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def sass(kernel) -> str:
    """The kernel's SASS, from the nvdisasm that ships with Triton."""
    import triton

    nvdisasm = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout


def main_loop(text: str) -> list[str]:
    """The instructions of the longest loop (from a label to the branch back to it)."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\.(L_x_\d+):", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if _INSTRUCTION.match(x)]
            best = body if len(body) > len(best) else best
    return best


def opcode(line: str) -> str:
    m = _INSTRUCTION.match(line)
    assert m is not None
    text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2))  # a predicate
    return text.split()[0].rstrip(";").split(".")[0]


def _lanes(ggml_type: int, quads: int) -> int:
    from engine.kernels import quant_gemv as qg

    try:
        return qg.lanes(ggml_type, quads)
    except TypeError:  # an older checkout (a "before" run): one word a lane
        return qg.lanes(ggml_type)


def _x16_args(x16: bool) -> tuple[dict[str, str], dict[str, object]]:
    """The x operand's signature and constants: bf16 x, or (x16) int16 x with its float32
    groups and dp2a in PTX; an older checkout (before x16) takes neither."""
    from engine.kernels import quant_gemv as qg

    if not hasattr(qg, "X16_TYPES"):
        return {}, {}
    return {"xg": "*fp32"}, {"X16": x16, "ASM": True}


def gemv_row(ggml_type: int, width: int, config: tuple[int, ...], x16: bool = False) -> dict:
    """quant_gemv's `_gemv_kernel` at (BLOCK_N, SB, num_warps[, QUADS]), bf16 x, or x16: x as
    `engine.kernels.x16`'s int16 values (`_quad_dot_x16`)."""
    from engine.kernels import quant_gemv as qg

    block_n, sb, warps, quads = (*config, 1)[:4]
    xg, flags = _x16_args(x16)
    constants = {"QTYPE": ggml_type, "UNIT_BYTES": qg.unit_bytes(ggml_type),
                 "ROW_BYTES": qg.row_nbytes(ggml_type, width), "K": width, "BLOCK_N": block_n, "SB": sb,
                 "LANES": _lanes(ggml_type, quads), "QUADS": quads, "EVEN_N": True, **flags}
    kernel = compiled(qg._gemv_kernel, {"x": "*i16" if x16 else "*bf16", "x_stride": "i32", **xg, "w": "*u8",
                                        "y": "*bf16", "n_rows": "i32", "magic": "i32"}, constants, num_warps=warps)
    return {"kernel": "quant_gemv x16" if x16 else "quant_gemv", "ggml_type": ggml_type, "width": width,
            **_walk_stats(kernel, config)}


def _walk_stats(kernel, config: tuple[int, ...], values: float | None = None, text: str | None = None) -> dict:
    """The main loop of a kernel that walks rows with `row_dots` at (BLOCK_N, SB, num_warps[,
    QUADS]), or of another kernel whose threads decode `values` weight values each per loop step
    (`text`: its SASS, if the caller has it already)."""
    block_n, sb, warps = config[:3]
    loop = main_loop(sass(kernel) if text is None else text)
    ops = collections.Counter(opcode(line) for line in loop)
    if values is None:
        values = block_n * sb * 256 / (32 * warps)  # weight values a thread decodes per loop step
    return {"config": list(config), "loop_instructions": len(loop),
            "instructions_per_value": round(len(loop) / values, 2), "shfl": ops["SHFL"], "bar": ops["BAR"],
            "lds_sts": ops["LDS"] + ops["STS"], "ldg": ops["LDG"], "ldgsts": ops["LDGSTS"],
            "shared_bytes": kernel.metadata.shared,
            "top_opcodes": ops.most_common(8)}


def expert_row(ggml_type: int, width: int, x16: bool = False) -> dict:
    """moe_quant's `_down_kernel` (a decode step's routed experts, down projection) at its
    type's config, with the float32 activations a float32 decode passes (x16: their int16
    values, as a bf16 decode passes them): the same loop statistics as `gemv_row`."""
    from engine.kernels import moe_quant as mq
    from engine.kernels import quant_gemv as qg

    if x16:
        config = qg.X16_CONFIGS[ggml_type]
    else:
        config = qg.config(ggml_type, width) if hasattr(qg, "config") else qg.CONFIGS[ggml_type]
    block_n, sb, warps, quads = (*config, 1)[:4]
    xg, flags = _x16_args(x16)
    constants = {"QTYPE": ggml_type, "UNIT_BYTES": qg.unit_bytes(ggml_type),
                 "ROW_BYTES": qg.row_nbytes(ggml_type, width), "INTER": width, "BLOCK_N": block_n, "SB": sb,
                 "LANES": _lanes(ggml_type, quads), "QUADS": quads, "EVEN_N": True, **flags}
    act = {"act": "*i16" if x16 else "*fp32", "act_stride": "i64", "ag": "*fp32"} if xg else {"act": "*fp32"}
    kernel = compiled(mq._down_kernel, {**act, "rows": "*i64", "down": "*u8", "down_stride": "i64",
                                        "weights": "*fp32", "y": "*fp32", "d_out": "i32", "magic": "i32"}, constants,
                      num_warps=warps)
    return {"kernel": "moe_quant down x16" if x16 else "moe_quant down", "ggml_type": ggml_type, "width": width,
            **_walk_stats(kernel, config)}


def mxfp4_row(role: str, d_in: int, inter: int) -> dict:
    """moe_mxfp4's `_gate_up_kernel` (bf16 x, swiglu with its clamp) or `_down_kernel` at
    GATE_UP_CONFIG / DOWN_CONFIG: the same loop statistics, per weight value a thread decodes
    per step (BLOCK_N rows x BLOCK_K values over 32 x num_warps threads; gate and up both count)."""
    from engine.kernels import moe_mxfp4 as mx

    if role == "gate_up":
        config = mx.GATE_UP_CONFIG
        block_n, block_k, warps = config
        kernel = compiled(mx._gate_up_kernel, {"x": "*bf16", "x_stride": "i32", "rows": "*i64", "gate": "*u8",
                                               "gate_stride": "i64", "up": "*u8", "up_stride": "i64", "act": "*fp32",
                                               "k_top": "i32", "inter": "i32", "p1": "fp32", "p2": "fp32"},
                          {"D_IN": d_in, "ACT": 0, "CLAMP": True, "BLOCK_N": block_n, "BLOCK_K": block_k,
                           "EVEN_N": inter % block_n == 0}, num_warps=warps, enable_fp_fusion=True)
        values = 2 * block_n * block_k / (32 * warps)
        width = d_in
    else:
        config = mx.DOWN_CONFIG
        block_n, block_k, warps = config
        kernel = compiled(mx._down_kernel, {"act": "*fp32", "rows": "*i64", "down": "*u8", "down_stride": "i64",
                                            "weights": "*fp32", "y": "*fp32", "d_out": "i32"},
                          {"INTER": inter, "BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_N": d_in % block_n == 0},
                          num_warps=warps, enable_fp_fusion=True)
        values = block_n * block_k / (32 * warps)
        width = inter
    return {"kernel": f"mxfp4 {role}", "ggml_type": 39, "width": width, **_walk_stats(kernel, config, values)}


def prefill_row(role: str, tiles: tuple[int, int, int, int], block_m: int, asm: bool = True) -> dict:
    """moe_mxfp4_prefill's `_gate_up_kernel` or `_down_kernel` (bf16 x, swiglu with its clamp) at
    tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) and BLOCK_M, DeepSeek-V4's widths (every
    pointer, stride and width a multiple of 16, as at launch): the main loop's statistics per
    weight value a thread decodes per K step (gate and up both count), the asynchronous
    global-to-shared copies in its loop (LDGSTS: the loads Triton's pipeliner copies ahead),
    and the spill loads and stores (LDL / STL) in the whole kernel. `asm`: decode the weights
    with the packed bf16 assembly (default) or in float32 math."""
    from engine.kernels import moe_mxfp4_prefill as pf

    block_n, block_k, warps, stages = tiles
    constants = {"SCALE_MODE": 0, "IEEE": False, "ASM": asm, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                 "GROUP_M": pf.GROUP_M}
    if role == "gate_up":
        kernel = compiled(pf._gate_up_kernel, {"x": "*bf16", "x_stride": "i32", "sorted_ids": "*i32",
                                               "block_expert": "*i32", "gate_v": "*u8", "gate_s": "*u8",
                                               "up_v": "*u8", "up_s": "*u8", "v_stride": "i32", "s_stride": "i32",
                                               "act": "*bf16", "k_top": "i32", "d_in": "i32", "inter": "i32",
                                               "n_blocks": "i32", "first": "i32", "group": "i32", "p1": "fp32",
                                               "p2": "fp32"},
                          {**constants, "ACT": 0, "CLAMP": True},
                          ("x", "x_stride", "sorted_ids", "block_expert", "gate_v", "gate_s", "up_v", "up_s",
                           "v_stride", "s_stride", "act", "d_in", "inter"), num_warps=warps, num_stages=stages)
        values = 2 * block_n * block_k / (32 * warps)
    else:
        kernel = compiled(pf._down_kernel, {"act": "*bf16", "sorted_ids": "*i32", "block_expert": "*i32",
                                            "down_v": "*u8", "down_s": "*u8", "v_stride": "i32", "s_stride": "i32",
                                            "weights": "*fp32", "y": "*fp32", "inter": "i32", "d_out": "i32",
                                            "n_blocks": "i32", "first": "i32", "group": "i32"},
                          constants, ("act", "sorted_ids", "block_expert", "down_v", "down_s", "v_stride", "s_stride",
                                      "weights", "y", "inter", "d_out"), num_warps=warps, num_stages=stages)
        values = block_n * block_k / (32 * warps)
    text = sass(kernel)
    ops = collections.Counter(opcode(line) for line in text.splitlines() if _INSTRUCTION.match(line))
    stats = _walk_stats(kernel, tiles, values, text)
    return {"kernel": f"mxfp4 prefill {role}" + ("" if asm else " f32-decode"), "ggml_type": 39, "block_m": block_m,
            **stats, "async_copies": stats["ldgsts"], "spill_loads": ops["LDL"], "spill_stores": ops["STL"]}


def split_row() -> dict:
    """moe_mxfp4_prefill's `_split_kernel` (the copy of the used experts into the split layout)
    at its launch shape (SPLIT_ROWS x SPLIT_BLOCKS MXFP4 blocks a step, SPLIT_WARPS warps): the main loop's
    statistics per MXFP4 block a thread copies per step ("per value": per block here)."""
    from engine.kernels import moe_mxfp4_prefill as pf

    kernel = compiled(pf._split_kernel, {"table": "*u8", "table_stride": "i32", "used": "*i32", "n_experts": "i32",
                                         "first": "i32", "values": "*u8", "scales": "*u8", "values_stride": "i32",
                                         "scales_stride": "i32", "n_rows": "i32", "width": "i32"},
                      {"BLOCK_R": pf.SPLIT_ROWS, "BLOCK_B": pf.SPLIT_BLOCKS},
                      ("table", "table_stride", "values", "scales", "values_stride", "scales_stride", "n_rows",
                       "width"), num_warps=pf.SPLIT_WARPS)
    blocks = pf.SPLIT_ROWS * pf.SPLIT_BLOCKS / (32 * pf.SPLIT_WARPS)
    return {"kernel": "mxfp4 split copy", "ggml_type": 39,
            **_walk_stats(kernel, (pf.SPLIT_ROWS, pf.SPLIT_BLOCKS, pf.SPLIT_WARPS), blocks)}


def attention_row(dtype: str, stages: int, picks: bool) -> dict:
    from engine.kernels import decode_attention as da

    pointer = {"bfloat16": "*bf16", "float32": "*fp32"}[dtype]
    signature = {"q_ptr": pointer, "window_ptr": pointer, "entries_ptr": pointer, "index_ptr": "*i64",
                 "pos_ptr": "*i64", "acc_ptr": "*fp32", "stats_ptr": "*fp32", "heads": "i32", "d": "i32",
                 "dv": "i32", "n_window": "i32", "n_comp": "i32", "ratio": "i32", "keys_per_split": "i32",
                 "splits": "i32", "scale": "fp32"}
    constants = {"PICKS": picks, "TAIL": False, "BLOCK_H": da._BLOCK_H, "BLOCK_N": da._BLOCK_N, "BLOCK_D": 512,
                 "BLOCK_T": 16, "IEEE": dtype == "float32"}  # DeepSeek-V4: keys are the values (d = dv = 512)
    kernel = compiled(da._split_kernel, signature, constants, num_warps=4, num_stages=stages)
    chosen = da._stages(getattr(torch, dtype), 512)
    return {"kernel": "decode_attention", "dtype": dtype, "block_d": 512, "num_stages": stages, "picks": picks,
            "the_product_uses": stages == chosen, "shared_bytes": kernel.metadata.shared,
            "fits_hopper": kernel.metadata.shared <= HOPPER_SHARED_BYTES}


def _code_version() -> dict:
    """The commit the kernels were read from, and whether the work tree differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "engine"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("kernel_sass: needs Triton (pip install triton); no GPU is needed")
        return 2
    from engine.kernels import quant_gemv as qg

    rows = [gemv_row(t, 4096 if t == 8 else 7168, qg.CONFIGS[t]) for t in (8, 10, 11, 14)]
    if hasattr(qg, "X16_CONFIGS"):
        rows += [gemv_row(t, 4096 if t == 8 else 7168, qg.X16_CONFIGS[t], x16=True) for t in sorted(qg.X16_TYPES)]
    rows += [expert_row(t, width) for t, width in ((10, 3072), (11, 3072))]  # Kimi-K3's expert down (inter 3072)
    if hasattr(qg, "X16_CONFIGS"):
        rows += [expert_row(t, width, x16=True) for t, width in ((10, 3072), (11, 3072))]
    rows += [mxfp4_row(role, 4096, 2048) for role in ("gate_up", "down")]  # DeepSeek-V4-Flash's routed experts
    from engine.kernels import moe_mxfp4_prefill as pf

    # A 512-token chunk of DeepSeek-V4's (BLOCK_M 16) and a 4,096-token one (64), at the default tiles and 8 warps;
    # then at the default tiles with the weights decoded in float32 math (EXPERTDESK_MXFP4_ASM=0)
    defaults = {"gate_up": pf.GATE_UP_CONFIG, "down": pf.DOWN_CONFIG}
    rows += [prefill_row(role, tiles, block_m) for role, (n, k, _w, stages) in defaults.items() for block_m in (16, 64)
             for tiles in (defaults[role], (n, k, 8, stages))]
    rows += [prefill_row(role, tiles, block_m, asm=False) for role, tiles in defaults.items() for block_m in (16, 64)]
    rows.append(split_row())
    rows += [attention_row(dtype, stages, picks) for dtype in ("bfloat16", "float32") for stages in (1, 3)
             for picks in (False, True)]
    print(f"{'kernel':16} {'type/dtype':10} {'config':12} {'loop ins':>8} {'per value':>9} {'SHFL':>5} {'BAR':>4} "
          f"{'LDS/STS':>7} {'shared B':>9}")
    for r in rows:
        if r["kernel"] in ("quant_gemv", "quant_gemv x16", "moe_quant down", "moe_quant down x16", "mxfp4 gate_up",
                           "mxfp4 down", "mxfp4 split copy") or r["kernel"].startswith("mxfp4 prefill"):
            spills = (f"  M={r['block_m']} async {r['async_copies']} spills {r['spill_loads']}/{r['spill_stores']}"
                      if "block_m" in r else "")
            print(f"{r['kernel']:18} {r['ggml_type']:<10} {str(r['config']):12} {r['loop_instructions']:>8} "
                  f"{r['instructions_per_value']:>9} {r['shfl']:>5} {r['bar']:>4} {r['lds_sts']:>7} "
                  f"{r['shared_bytes']:>9}{spills}")
        else:
            layer = "CSA" if r["picks"] else "HCA/window"
            print(f"{'decode_attention':16} {r['dtype']:10} {'stages ' + str(r['num_stages']):12} {layer:>8} {'':>9} "
                  f"{'':>5} {'':>4} {'':>7} {r['shared_bytes']:>9}{'' if r['fits_hopper'] else '  > sm_90 limit'}")
    now = dt.datetime.now(dt.timezone.utc)
    result = {**result_header("kernel-sass", __file__, argv, kernel_machine("cpu", triton), now),
              "target": "cuda sm_90 (compiled ahead of time, no GPU)", "hopper_shared_bytes": HOPPER_SHARED_BYTES,
              "code": _code_version(), "rows": rows}
    write_result(result, args.out, "kernel-sass", now)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
