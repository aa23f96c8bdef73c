// glake::presets: the host and simulated presets instantiated once, so that translation units
// that define GLAKE_PRESETS_EXTERN (every user of the CMake target glake::presets) skip
// generating their code. The GPU presets are not here: they need the CUDA driver's library.
#include "glake/presets.hpp"

#if !defined(GLAKE_PRESETS_EXTERN)
#error "src/presets.cpp is built with GLAKE_PRESETS_EXTERN (the glake::presets target defines it)"
#endif

namespace glake {

GLAKE_PRESETS_INSTANTIATE(template)

}  // namespace glake
