"""Time how a routing event reads the FP entries, both ways, in one process (issue 25, session 27).

    python scripts/routing_reads_time.py --context 8192

After a prefill of ``--context`` tokens and a few decode steps (dbtrimkv + INT2 tiers at 0.1,
SmolLM2, fp32), alternates, ``--repeats`` times, over all layers:

the FP entries' padded view with every key and value (what events read before session 27) against
the view without keys and values plus ``EntrySource.read`` of the entries an event moves (here the
last 40 columns of each row, a few hundred entries a layer, as an event demotes).

Prints one JSON line with the median and fastest ms of each. Alternating in one process keeps a
busy or slow machine from favouring either side.
"""

import json
import time

import torch
from routing_event_time import prefilled, prompt_arguments  # scripts/ is on sys.path when run as a script


def main() -> None:
    p = prompt_arguments(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args()
    model, ids, cache = prefilled(args)
    with torch.no_grad():
        token = ids[:, args.context : args.context + 1]
        for _ in range(13):  # past one routing event, a few tail tokens
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    stores = [layer.store for layer in cache.layers]
    states = stores[0].state_names

    def moved(view):
        return torch.nonzero(view.valid[..., -40:], as_tuple=True)

    def views_padded() -> None:
        for s in stores:
            v = s.padded_view(with_values=True, states=states)
            b, h, col = moved(v)
            v.keys[b, h, col], v.values[b, h, col]

    def views_source() -> None:
        for s in stores:
            v = s.padded_view(with_values=False, with_keys=False, states=states)
            s.entry_source().read(*moved(v))

    cases = {"views_padded": views_padded, "views_source": views_source}
    ms: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            ms[name].append((time.perf_counter() - start) * 1000)
    out = {"context": args.context, "threads": args.threads, "layers": len(stores), "repeats": args.repeats}
    for name, v in ms.items():
        v.sort()
        out[f"{name}_ms_median"], out[f"{name}_ms_min"] = round(v[len(v) // 2], 2), round(v[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
