"""A module that starts a thread when imported (what run.preload must not do)."""
import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="preloaded").start()
