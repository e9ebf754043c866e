import time, statistics, torch, sys, threading
sys.path.insert(0, '.')
from scripts.bench_memory_history import build, run_steps
dev = torch.device('cuda')
R = torch.cuda.memory._record_memory_history
modes = {
 'off': dict(enabled=None),
 'trace-nostack': dict(enabled='all', context=None, stacks='python', max_entries=100000),
 'alloc-python': dict(enabled='all', context='alloc', stacks='python', max_entries=100000),
 'state': dict(enabled='state', context='state', stacks='python'),
 'all-python': dict(enabled='all', context='all', stacks='python', max_entries=100000),
}
for wl in ('small','medium'):
    model,opt,x = build(wl, dev)
    run_steps(model,opt,x,10)
    s0 = torch.cuda.memory_stats(); t0=time.perf_counter()
    run_steps(model,opt,x,20); dt=time.perf_counter()-t0
    s1 = torch.cuda.memory_stats()
    ev = (s1['allocation.all.allocated']-s0['allocation.all.allocated'] + s1['allocation.all.freed']-s0['allocation.all.freed'])/20
    print(wl, 'events/step', ev, 'step ms', dt/20*1000, flush=True)
    res = {m: [] for m in modes}
    for r in range(5):
        for m, kw in modes.items():
            R(**kw); run_steps(model,opt,x,5)
            res[m].append(statistics.median(run_steps(model,opt,x,30)))
    R(enabled=None)
    base = statistics.median(res['off'])
    for m in modes:
        med = statistics.median(res[m]); rs = [v/b for v,b in zip(res[m],res['off'])]
        print(f"  {m:16s} {med*1000:8.3f} ms ratio {med/base:.4f}  paired {min(rs):.3f}-{max(rs):.3f}  per-event us {(med-base)/ev*1e6:.3f}", flush=True)
    # costs of controls
    ts=[]
    for i in range(50):
        t=time.perf_counter(); torch.cuda.memory_stats(0); ts.append(time.perf_counter()-t)
    print('  memory_stats us', statistics.median(ts)*1e6)
    ts=[]
    for i in range(50):
        t=time.perf_counter(); torch._C._cuda_memoryStats(0); ts.append(time.perf_counter()-t)
    print('  _cuda_memoryStats us', statistics.median(ts)*1e6)
    ts=[]
    R(**modes['trace-nostack'])
    for i in range(50):
        t=time.perf_counter(); R(**modes['alloc-python']); R(**modes['trace-nostack']); ts.append((time.perf_counter()-t)/2)
    print('  toggle context us', statistics.median(ts)*1e6)
    # does the ring keep events across context toggles? do blocks keep frames after off?
    R(**modes['alloc-python'], clear_history=True); run_steps(model,opt,x,1); R(**modes['trace-nostack']); run_steps(model,opt,x,1)
    snap = torch.cuda.memory._snapshot()
    tr = snap['device_traces'][0]
    print('  trace events', len(tr), 'with frames', sum(1 for e in tr if e.get('frames')))
    blocks=[b for s in snap['segments'] for b in s['blocks'] if b['state']=='active_allocated']
    print('  active blocks', len(blocks), 'with frames', sum(1 for b in blocks if b.get('frames')))
    R(enabled=None)
    snap = torch.cuda.memory._snapshot()
    blocks=[b for s in snap['segments'] for b in s['blocks'] if b['state']=='active_allocated']
    print('  after off: events', len(snap['device_traces'][0]), 'active blocks', len(blocks), 'with frames', sum(1 for b in blocks if b.get('frames')))
    # toggle from another thread while training
    stop=False; n=[0]
    def tog():
        while not stop:
            R(**modes['alloc-python']); time.sleep(0.005); R(**modes['trace-nostack']); time.sleep(0.02); n[0]+=1
    th=threading.Thread(target=tog); th.start(); run_steps(model,opt,x,200); stop=True; th.join()
    print('  bg toggles ok', n[0], flush=True)
    del model,opt,x; torch.cuda.empty_cache()
