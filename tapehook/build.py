"""`python -m tapehook.build`: build (or find cached) kernels and print kernel_info."""

import json

if __name__ == "__main__":
    import tapehook  # builds (or finds cached) and loads the kernels at import

    info = tapehook.kernel_info()
    print(json.dumps(info, indent=1, default=str))
    if not info["cpu"]["loaded"]:
        raise SystemExit(f"kernels not built: {info['cpu']['reason']}")
