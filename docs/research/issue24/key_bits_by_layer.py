"""The served best policy with key tables of each mean width, per layer; then the best width
per layer at the same mean (3.75), chosen on the judged capture itself (an optimistic bound
for tables of different widths per layer).

    python key_bits_by_layer.py topics.npz out.json 3.0 3.25 3.5 3.75 4.0 4.25 4.5

Each width B needs prB.npz from `kvq calibrate ... --mean-bits B --mean-query --pre-rope`
in TABLES (default /tmp/s5)."""
import dataclasses, itertools, json, os, sys
import numpy as np
from kvq_jax.core.policies import POLICIES
from kvq_jax.core.calibration import with_key_tables
from kvq_jax.report import capture as cap, evaluate as ev
TABLES = os.environ.get("TABLES", "/tmp/s5")
c = cap.select(cap.load_capture(sys.argv[1]), layers=[0, 5, 10, 15, 20, 25, 29])
widths = sys.argv[3:]
ps = [POLICIES["int4-g64+win"]]
for b in widths:
    p = with_key_tables(POLICIES["intb-prerope-hint4-heavy-smollm2+win"], f"{TABLES}/pr{b}.npz")
    ps.append(dataclasses.replace(p, name=b))
out = {}
for r in ev.evaluate(c, ps, show_progress=False):
    lh = np.array(r.attention_decode_layer_head)
    out[r.name] = dict(bits=r.bits_per_element, layer=lh.mean(1).tolist(), dec=r.attention_decode_mean)
    print(r.name, r.k_bits_per_element, f"{100 * r.attention_decode_mean:.3f}%",
          np.round(100 * lh.mean(1), 3), flush=True)
json.dump(out, open(sys.argv[2], "w"))
best = None
for combo in itertools.product(widths, repeat=7):
    if sum(map(float, combo)) > 3.75 * 7 + 1e-9:
        continue
    e = np.mean([out[b]["layer"][i] for i, b in enumerate(combo)])
    best = min(best or (e, combo), (e, combo))
print("best widths per layer", best[1], f"{100 * best[0]:.3f}%",
      f"{best[0] / out['int4-g64+win']['dec']:.3f}x int4-g64+win")
