# The library is built as one OBJECT target per layer (docs/architecture.md), linked into the one
# shared libhyperparallel. Each layer compiles against include roots that hold only what it may
# see, so an include that breaks the layering is a build error ("No such file"):
#   build/layers/<layer>/include/hp/<layer> -> include/hp/<layer>  (its public headers; the layers
#                                                                 it links add theirs, transitively)
#   build/layers/<layer>/src/<layer>         -> src/<layer>          (its private headers, its own only)
#
#   hp_layer(<layer> <layers it uses directly>...)

function(hp_layer layer)
  set(root ${CMAKE_BINARY_DIR}/layers/${layer})
  file(MAKE_DIRECTORY ${root}/include/hp ${root}/src)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/hp/${layer} ${root}/include/hp/${layer} SYMBOLIC)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${layer} ${root}/src/${layer} SYMBOLIC)
  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${layer}/*.cpp)
  add_library(hp_${layer} OBJECT ${sources})
  target_include_directories(hp_${layer} PUBLIC ${root}/include PRIVATE ${root}/src ${CMAKE_BINARY_DIR}/generated)
  list(TRANSFORM ARGN PREPEND hp_ OUTPUT_VARIABLE deps)
  target_link_libraries(hp_${layer} PUBLIC ${deps} ${TORCH_LIBRARIES} Threads::Threads)
  hp_torch_target(hp_${layer})
  set_property(GLOBAL APPEND PROPERTY HP_LAYERS ${layer})
endfunction()
