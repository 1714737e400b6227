"""A client script that serves requests until it is interrupted; writes its pid first."""

import os
import sys
import time

from llmrl import Caller

if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    with Caller() as caller:
        while True:
            caller.score(["a context"], [[" a", " b"]])
            time.sleep(0.2)
