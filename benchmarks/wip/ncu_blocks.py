"""Basic blocks (runs of equal execution counts) of an address range of an Nsight Compute
per-SASS-address CSV, heaviest first: instructions per voxel, stall samples, opcode mix.
Fifty-third session.

    python benchmarks/wip/ncu_blocks.py h3f_sass.csv 16777216 0xb04e0 0xc2c20 [TOP]
"""
import csv, sys
f, voxels, lo, hi = sys.argv[1], float(sys.argv[2]), int(sys.argv[3],16), int(sys.argv[4],16)
rows = list(csv.reader(open(f))); hdr = rows[1]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
def num(r, k):
    try: return float(r[ix[k]].replace(',', ''))
    except: return 0.0
blocks = []; cur = None
for r in data:
    a = int(r[0], 16) & 0xfffff
    if not (lo <= a <= hi): continue
    e = num(r, 'Instructions Executed')
    if cur and cur['e'] == e and not cur['end']:
        cur['n'] += 1; cur['ti'] += num(r, 'Thread Instructions Executed'); cur['s'] += num(r,'Warp Stall Sampling (All Samples)'); cur['last']=a; cur['txt'].append(r[1].strip())
    else:
        cur = {'a': a, 'last': a, 'e': e, 'n': 1, 'ti': num(r, 'Thread Instructions Executed'), 's': num(r,'Warp Stall Sampling (All Samples)'), 'end': False, 'txt':[r[1].strip()]}
        blocks.append(cur)
    if 'BRA' in r[1] or 'BSYNC' in r[1]: cur['end'] = True
tot = sum(b['ti'] for b in blocks)
for b in sorted(blocks, key=lambda b: -b['ti'])[:int(sys.argv[5]) if len(sys.argv)>5 else 25]:
    ops = {}
    for t in b['txt']:
        import re
        o = re.sub(r'^@!?U?P\w+\s+', '', t).split()[0].split('.')[0]; ops[o] = ops.get(o,0)+1
    print(f"{b['a']:05x}-{b['last']:05x} n={b['n']:4d} exec={b['e']:9.0f} instr/voxel {b['ti']/voxels:5.2f} samp {b['s']:5.0f}  {dict(sorted(ops.items(), key=lambda x:-x[1])[:7])}")
print('total', tot/voxels)
