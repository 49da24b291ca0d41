"""`python -m tapehook.build`: build (or find cached) kernels and print kernel_info."""

import json

if __name__ == "__main__":
    from tapehook import kernels

    record = kernels.build()
    print(json.dumps({k: record[k] for k in ("path", "tf_version", "fresh_build")}, indent=1))
