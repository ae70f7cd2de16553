# fusedce — the front door. Everything real is in CMakeLists.txt.
#   make            build build/libfusedce.so (CUDA backend when nvcc is found)
#   make demo       set up, build, run examples/demo (GPU when there is one, else CPU)
#   make test       set up, build, run every test that needs no GPU (what CI runs)
#   make test-gpu   the same suites on the CUDA backend, under compute-sanitizer, torch parity
#   make bench      the benchmarks (on a GPU machine); writes bench/results/
#   make bench-cpu  the CPU backend against torch CPU (or NumPy); writes bench/results/cpu-*.json
#   make tables     the tables of README.md and docs/*.md from bench/results (bench/tables.py)
#   make fuzz       the libFuzzer target over the one-GPU entry points' argument checks (CPU backend,
#                   clang, ASan+UBSan; tests/fuzz): FUZZ_SECONDS (300) of it, from the corpus in
#                   tests/fuzz/corpus; FUZZ_MERGE=1 adds what it found there. make test: 60 s
#   make test-asan  the CPU test suites built with AddressSanitizer + UBSan (build-asan/)
#   make wheels     the manylinux wheels fusedce-cu13 (and fusedce-cu12 where a CUDA 12.8+ toolkit
#                   is) into WHEELHOUSE (.wheelhouse): tools/build_wheels.sh, docs/install.md
#   make install PREFIX=/usr/local
BUILD ?= build
PREFIX ?= /usr/local
JOBS ?= $(shell nproc)
CUDA_ARCHS ?= 80-real;90-real;100-real;120
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
WITH_CUDA ?= $(if $(NVCC),ON,OFF)
PYTHON ?= python3
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 300
ASAN_BUILD ?= build-asan
WHEELHOUSE ?= .wheelhouse

.PHONY: all setup setup-demo configure build demo test test-gpu bench bench-cpu tables install clean fuzz test-asan wheels

all: build

setup:
	@bash tools/setup.sh test

setup-demo:
	@bash tools/setup.sh demo

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DFCE_WITH_CUDA=$(WITH_CUDA) \
	  "-DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS)" $(if $(NVCC),-DCMAKE_CUDA_COMPILER=$(NVCC)) \
	  -DCMAKE_INSTALL_PREFIX=$(PREFIX)

# An existing build/ keeps the CUDA architectures it was configured with: re-configure when
# `make CUDA_ARCHS=...` asks for others (cmake would otherwise keep the cached value silently).
CACHED_ARCHS = $(shell sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' $(BUILD)/CMakeCache.txt 2>/dev/null)
configure: $(BUILD)/CMakeCache.txt
	@if [ "$(WITH_CUDA)" = ON ] && [ -n "$(CACHED_ARCHS)" ] && [ "$(CACHED_ARCHS)" != "$(CUDA_ARCHS)" ]; then \
	  echo "configure: CUDA_ARCHS changed ($(CACHED_ARCHS) -> $(CUDA_ARCHS)): re-configuring $(BUILD)"; \
	  cmake -S . -B $(BUILD) "-DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS)" >/dev/null; fi

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: setup-demo build
	$(BUILD)/examples/demo

test: setup build
	@FUZZ_BUILD=$(FUZZ_BUILD) ASAN_BUILD=$(ASAN_BUILD) bash tools/run_tests.sh $(BUILD)

fuzz: setup
	@bash tools/run_fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

test-asan: setup
	@bash tools/run_asan.sh $(ASAN_BUILD)

test-gpu: build
	@bash tools/run_gpu_tests.sh $(BUILD)

bench: build
	@bash bench/run.sh $(BUILD)

bench-cpu: build
	FUSEDCE_LIBRARY=$(BUILD)/libfusedce.so PYTHONPATH=bindings/python $(PYTHON) bench/bench_cpu.py

tables:
	$(PYTHON) bench/tables.py --write

wheels:
	@CUDA_ARCHS="$(CUDA_ARCHS)" bash tools/build_wheels.sh $(WHEELHOUSE)

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD) $(FUZZ_BUILD) $(ASAN_BUILD)
