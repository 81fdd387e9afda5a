// Compiled by the layering tests with one layer's include roots only (cmake/HpLayers.cmake): a
// header of a layer below is found, and the include the test names must not be.
#include "hp/core/chunking.h"  // core is below every layer: found
#include HP_REACH              // above the layer, or another layer's private header: not found
