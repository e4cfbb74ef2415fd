import dataclasses

from kvq_jax.core.policies import POLICIES
from kvq_jax.report.capture import load_capture
from kvq_jax.report.evaluate import evaluate

cap = load_capture()
ps = []
for name in ("int4-g64", "intb-hint4-smollm2", "int4-g64+win", "intb-hint4-smollm2+win"):
    p = POLICIES[name]
    ps.append(dataclasses.replace(p, name=name.replace("+win", "") + "-abs" + ("+win" if "+win" in name else ""), absolute=(1, 2, 3)))
for r in evaluate(cap, ps, show_progress=False):
    print(f"{r.name:32s} {r.bits_per_element:.3f} attn {100*r.attention_mean:.3f} dec {100*r.attention_decode_mean:.3f} final-loop dec {100*r.attention_decode_final_loop_mean:.3f}")
