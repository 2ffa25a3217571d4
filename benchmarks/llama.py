"""A Llama-3.2-1B-shaped model on one TPU v5e chip: which policies fit, and what
`eo.chunked_cross_entropy` saves over the plain loss on its 128k vocabulary, with
the tied table on the device and streamed from the host (`Policy(host_tables=...)`).

    python benchmarks/llama.py [--json FILE]

The model: dim 2048, 16 blocks of grouped-query attention (32 query heads, 8
key/value heads, head dim 64, RoPE; 256 queries at a time, as a fused attention
kernel would) and a SwiGLU MLP (8192), RMSNorm, a tied 128256-token embedding;
1.24e9 parameters, fp32, AdamW; batch 8 x 1024 tokens. Abstract
(`eqx.filter_eval_shape`) and only compiled: the whole `train_step`.
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
from _common import GIB, parser, table, write_json
from models import decoder
from models.decoder import chunked_loss, plain_loss, trunk_only
from models.shapes import BATCH, LLAMA_3_2_1B, SEQ

import eqx_offload as eo


PRESETS = ("none", "remat", "offload_residuals", "offload_all")


# "streamed": the chunked loss with the tied table left on the host and read by
# blocks of rows (`Policy(host_tables=("embed",))`); only where the table is on the
# host.
# "trunk only": the same without the head, what no loss can go below.
LOSSES = {
    "plain": plain_loss,
    "chunked": chunked_loss,
    "streamed": chunked_loss,
    "trunk only": trunk_only,
}
STREAMED = ("streamed", "trunk only")


def report(preset: str, loss: str, target: str) -> eo.MemoryReport:
    stream = ("embed",) if loss in STREAMED else ()
    policy = getattr(eo.Policy, preset)(host_tables=stream)
    return decoder.step_report(
        LLAMA_3_2_1B, policy, LOSSES[loss], target=target, batch=BATCH, seq=SEQ
    )


def main():
    p = parser(__doc__)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--target", default="tpu-v5e")
    args = p.parse_args()
    n = decoder.parameters(LLAMA_3_2_1B)
    logits = BATCH * SEQ * LLAMA_3_2_1B.vocab * 4
    print(f"{n / 1e9:.3f}e9 parameters; full logits {logits / GIB:.2f} GiB")
    rows = []
    for preset in args.presets:
        for loss in LOSSES:
            if loss in STREAMED and preset != "offload_all":
                continue
            row = {"preset": preset, "loss": loss}
            try:
                r = report(preset, loss, args.target)
            except eo.DoesNotFit as e:
                need = e.required_bytes
                row.update({"device GiB": None, "host GiB": None, "fits": False})
                row["note"] = (
                    "does not fit" if need is None else f"needs {need / GIB:.2f}G"
                )
            else:
                row.update(
                    {
                        "device GiB": r.device_bytes / GIB,
                        "host GiB": r.host_bytes / GIB,
                        "fits": r.fits,
                        "note": "",
                    }
                )
            rows.append(row)
            print(row, flush=True)
    headers = list(rows[0])
    print(table(headers, [[row.get(h) for h in headers] for row in rows]))
    found = {r["loss"]: r["device GiB"] for r in rows if r["preset"] == "offload_all"}
    summary = {}
    if {"plain", "streamed", "trunk only"} <= found.keys():
        saved = found["plain"] - found["streamed"]
        most = found["plain"] - found["trunk only"]
        print(
            f"offload_all: the streamed loss needs {saved:.2f} GiB less than the "
            f"plain one = {saved * GIB / logits:.3f}x the full logits; no head at "
            f"all would save {most:.2f} GiB ({most * GIB / logits:.3f}x), so the "
            f"streamed head costs {found['streamed'] - found['trunk only']:.3f} GiB"
        )
        summary = {
            "saved GiB": saved,
            "saved / logits": saved * GIB / logits,
            "most any loss can save GiB": most,
            "most / logits": most * GIB / logits,
            "streamed head GiB": found["streamed"] - found["trunk only"],
        }
    write_json(
        args.json,
        "llama",
        {
            "target": args.target,
            "parameters": n,
            "logits_bytes": logits,
            "rows": rows,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
