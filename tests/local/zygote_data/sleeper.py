import time

print("sleeper up", flush=True)
time.sleep(3600)
