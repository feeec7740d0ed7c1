"""Per-phase wall seconds (steps 2-3) of the pipeline.py --json files in a folder: npu-train stage 0
(compute, bubble, collectives) and the optimizer, torch rank 0 (compute inside schedule.step, the rest of
schedule.step, tied + norm + all-reduce, optimizer), and both sides' stage-1 collectives.

Usage: python abtab.py experiments/bench/results/overhead
"""
import json, glob, statistics as st
for f in sorted(glob.glob(__import__('sys').argv[1] + '/*.json')):
    d = json.load(open(f)); tag = f.split('/')[-1]
    out = {}
    for r in d['results']:
        if 'metrics' in r:
            ms = r['metrics'][1:]
            # stage 0 = card 0; collectives+optimizer: slowest card's
            out['proj'] = (r['tokens_per_s'], [round(m['step_s'],2) for m in ms],
                           [round(m['compute_s_cards'][0],2) for m in ms], [round(m['bubble_s_cards'][0],2) for m in ms],
                           [round(m['collective_s_cards'][0],2) for m in ms], [round(m['optimizer_s'],2) for m in ms],
                           [round(m['collective_s_cards'][1],2) for m in ms])
        if 'phases' in r and r.get('tokens_per_s'):
            ph0 = r['phases'][0][1:]; ph1 = r['phases'][1][1:]
            out['torch'] = (r['tokens_per_s'], [round(x,2) for x in r['step_s'][1:]],
                            [round(p['compute_s'],2) for p in ph0], [round(p['schedule_s']-p['compute_s'],2) for p in ph0],
                            [round(p['tied_norm_s']+p['allreduce_s'],2) for p in ph0], [round(p['optimizer_s'],2) for p in ph0],
                            [round(p['tied_norm_s']+p['allreduce_s'],2) for p in ph1])
    print(f.split('/')[-1], tag)
    for k, v in out.items():
        print(f"  {k:5s} tok/s {v[0]:.1f} step {v[1]} s0 compute {v[2]} bubble {v[3]} coll {v[4]} opt {v[5]} | s1 coll {v[6]}")
    if len(out) == 2: print(f"  ratio {out['proj'][0]/out['torch'][0]:.3f}")
