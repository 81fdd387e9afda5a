# The library is built as one OBJECT target per layer (docs/architecture.md), linked into the one
# shared libhyperparallel. Each layer compiles against include roots that hold only what it may
# see, so an include that breaks the layering is a build error ("No such file"):
#   build/layers/<layer>/include/hp/<layer> -> include/hp/<layer>  (its public headers; the layers
#                                                                 it links add theirs, transitively)
#   build/layers/<layer>/src/<layer>         -> src/<layer>          (its private headers, its own only)
#
#   hp_layer(<layer> <layers it uses directly>...)
#
# Sources under src/<layer>/per_capability/ are compiled once per CPU capability, as ATen compiles
# its kernels: CPU_CAPABILITY (DEFAULT, AVX2, AVX512) names the namespace they define (and
# at::vec's), and the -m flags let at::vec use that capability's vectors; the layer picks one at
# run time. They skip the PCH (other flags), hide every symbol but their entry points, and come
# after the layers in the link, so an inline function they share with the rest (a c10 helper) keeps
# the portable copy.
set(HP_CAPABILITIES DEFAULT AVX2 AVX512)
set(HP_CAPABILITY_FLAGS_DEFAULT "")
set(HP_CAPABILITY_FLAGS_AVX2 -mavx2 -mfma -mf16c)
set(HP_CAPABILITY_FLAGS_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c)

function(hp_layer layer)
  set(root ${CMAKE_BINARY_DIR}/layers/${layer})
  file(MAKE_DIRECTORY ${root}/include/hp ${root}/src)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/hp/${layer} ${root}/include/hp/${layer} SYMBOLIC)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${layer} ${root}/src/${layer} SYMBOLIC)
  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${layer}/*.cpp)
  list(FILTER sources EXCLUDE REGEX "/per_capability/")
  add_library(hp_${layer} OBJECT ${sources})
  target_include_directories(hp_${layer} PUBLIC ${root}/include PRIVATE ${root}/src ${CMAKE_BINARY_DIR}/generated)
  list(TRANSFORM ARGN PREPEND hp_ OUTPUT_VARIABLE deps)
  target_link_libraries(hp_${layer} PUBLIC ${deps} ${TORCH_LIBRARIES} Threads::Threads)
  hp_torch_target(hp_${layer})
  set_property(GLOBAL APPEND PROPERTY HP_LAYERS ${layer})
  file(GLOB per_capability CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${layer}/per_capability/*.cpp)
  if(per_capability)
    foreach(capability ${HP_CAPABILITIES})
      set(target hp_${layer}_${capability})
      add_library(${target} OBJECT ${per_capability})
      target_include_directories(${target} PRIVATE ${root}/src)
      target_link_libraries(${target} PRIVATE ${TORCH_LIBRARIES})
      target_compile_definitions(${target} PRIVATE CPU_CAPABILITY=${capability} CPU_CAPABILITY_${capability})
      # -Wno-(maybe-)uninitialized: GCC 12 flags its own AVX512 intrinsics (_mm512_undefined_epi32) as
      # at::vec's bf16 conversions use them.
      # -fopenmp: at::parallel_for runs in parallel only where _OPENMP is defined (LibTorch's
      # OpenMP runtime is loaded already). Hidden visibility: only the entry points are exported.
      target_compile_options(${target} PRIVATE ${HP_WARNINGS} -Wno-maybe-uninitialized -Wno-uninitialized -fPIC
                                               -fopenmp -fvisibility=hidden -fvisibility-inlines-hidden
                                               ${HP_CAPABILITY_FLAGS_${capability}})
      set_property(GLOBAL APPEND PROPERTY HP_PER_CAPABILITY_OBJECTS $<TARGET_OBJECTS:${target}>)
    endforeach()
  endif()
endfunction()
