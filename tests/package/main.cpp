// Uses glake through its CMake package; run.cmake checks what this prints.
#include <glake/errors.hpp>

#include <cstdio>

#if __cplusplus < 202002L
#error "glake::glake must bring C++20"
#endif
#ifndef GLAKE_CHECKED
#error "glake::glake must define GLAKE_CHECKED"
#endif

int main() {
  std::printf("glake consumer: %s (GLAKE_CHECKED=%d)\n",
              glake::format_bytes(std::size_t{3} << 20).c_str(), GLAKE_CHECKED);
  return 0;
}
