import json, subprocess
for B in ["/tmp/ev/bench-base","/tmp/ev/bench-backoff"]:
    for ov,jobs in [(2,72),(5,180)]:
        w=[];ot=[]
        for seed in range(1,21):
            r=json.loads(subprocess.run([B,"sim","--service","mixed:900,3.5,0,1","--overload",str(ov),"--jobs",str(jobs),"--slots","auto","--seed",str(seed),"--deadline-ms","10000","--json"],capture_output=True,text=True,check=True).stdout)
            w.append(r["wasted_time"]); ot.append(r["on_time"])
        print(B.split('-')[-1], f"{ov}x cold: wasted mean {100*sum(w)/len(w):.2f}% worst {100*max(w):.2f}%, on-time total {sum(ot)}")
