// fuzz_replay_main.cpp — runs fuzz_api.cpp's LLVMFuzzerTestOneInput on files, without libFuzzer:
// the corpus in tests/fuzz/corpus as a ctest regression test (any compiler, the library as
// built), or one crash input from `make fuzz` under a debugger.
//   fuzz_replay FILE_OR_DIR...    every regular file, directories recursively, in name order
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv);
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  LLVMFuzzerInitialize(&argc, &argv);
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path p(argv[i]);
    if (fs::is_directory(p)) {
      for (const auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
    } else if (fs::is_regular_file(p)) {
      files.push_back(p);
    } else {
      std::fprintf(stderr, "fuzz_replay: %s: no such file or directory\n", argv[i]);
      return 2;
    }
  }
  std::sort(files.begin(), files.end());
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("fuzz_replay: %zu inputs, every check passed\n", files.size());
  if (files.empty()) {
    std::fprintf(stderr, "fuzz_replay: no inputs (is the corpus missing?)\n");
    return 1;
  }
  return 0;
}
