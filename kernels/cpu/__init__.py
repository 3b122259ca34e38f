"""CPU kernels: C sources in `csrc/`, built once per machine (`library`), and their ctypes wrappers
(`linear`, `attention`, `ops`, `stack`)."""
