"""Nsight Compute per-SASS-address CSV (ncu --page source --csv --print-source sass) split at the
kernel's block barriers: thread instructions per voxel, stall samples and the top stall reasons
per region, the whole launch's stalls and instruction mix. Fifty-third session.

    python benchmarks/wip/ncu_regions.py h3f_sass.csv 16777216
"""
import csv, sys, collections, re
f, voxels = sys.argv[1], float(sys.argv[2])
rows = list(csv.reader(open(f)))
hdr = rows[1]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
def num(r, k):
    v = r[ix[k]].replace(',', '')
    try: return float(v)
    except: return 0.0
stalls = [h for h in hdr if h.startswith('stall_') and 'Not Issued' not in h]
tot = sum(num(r, 'Thread Instructions Executed') for r in data)
samp = sum(num(r, 'Warp Stall Sampling (All Samples)') for r in data)
print(f"thread instr/voxel {tot/voxels:.1f}, samples {samp:.0f}")
# regions split at BAR.SYNC
regions = []; cur = []; 
for r in data:
    cur.append(r)
    if 'BAR.SYNC' in r[1]:
        regions.append(cur); cur = []
regions.append(cur)
agg = collections.Counter()
for k, reg in enumerate(regions):
    ti = sum(num(r, 'Thread Instructions Executed') for r in reg)
    sm = sum(num(r, 'Warp Stall Sampling (All Samples)') for r in reg)
    if ti / voxels < 0.5 and sm / samp < 0.01: continue
    st = collections.Counter()
    for r in reg:
        for s in stalls: st[s] += num(r, s)
    top = ', '.join(f"{s[6:]} {v/samp*100:.1f}%" for s, v in st.most_common(5))
    print(f"region {k} [{reg[0][0][-5:]}..{reg[-1][0][-5:]}] n={len(reg)} instr/voxel {ti/voxels:.1f} samples {sm/samp*100:.1f}%  {top}")
allst = collections.Counter()
for r in data:
    for s in stalls: allst[s] += num(r, s)
print('all stalls:', ', '.join(f"{s[6:]} {v/samp*100:.1f}%" for s, v in allst.most_common(10)))
ops = collections.Counter()
for r in data:
    op = re.sub(r'^@!?U?P\w+\s+', '', r[1].strip()).split()[0] if r[1].strip() else '?'
    ops[op.split('.')[0]] += num(r, 'Thread Instructions Executed')
print('mix/voxel:', ', '.join(f"{o} {v/voxels:.1f}" for o, v in ops.most_common(16)))
