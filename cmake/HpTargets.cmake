# Shared settings for every target that includes LibTorch.
#
# A translation unit that includes ATen costs ~10 s to parse here, so every such target reuses ONE
# precompiled header built by `hp_pch` (ATen, not torch.h: see cmake/pch.h). GCC only accepts a PCH built with the
# same flags, which is why every target is compiled with -fPIC (also executables) and no
# per-target definitions: a mismatch would silently fall back to parsing (-Winvalid-pch warns).

# GTest's imported target defines GTEST_HAS_PTHREAD=1 on its users; every target gets it so the
# library and the tests can share the PCH.
set(HP_COMMON_DEFINITIONS GTEST_HAS_PTHREAD=1)
if(HP_CUDA)
  list(APPEND HP_COMMON_DEFINITIONS HP_WITH_CUDA=1)  # the device build (docs/gpu.md)
endif()

add_library(hp_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch.cpp)
target_link_libraries(hp_pch PRIVATE ${TORCH_LIBRARIES})
target_compile_options(hp_pch PRIVATE ${HP_WARNINGS} -fPIC)
target_compile_definitions(hp_pch PRIVATE ${HP_COMMON_DEFINITIONS})
target_precompile_headers(hp_pch PRIVATE ${CMAKE_CURRENT_LIST_DIR}/pch.h)

function(hp_torch_target target)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF DEFINE_SYMBOL "")
  target_compile_options(${target} PRIVATE ${HP_WARNINGS} -fPIC)
  target_compile_definitions(${target} PRIVATE ${HP_COMMON_DEFINITIONS})
  target_precompile_headers(${target} REUSE_FROM hp_pch)
endfunction()
