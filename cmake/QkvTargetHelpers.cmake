# Per-target build settings shared by qkv's library, apps and tests.

# Warnings for qkv's own code; LibTorch's headers come in as SYSTEM so they stay quiet.
function(qkv_set_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
  endif()
endfunction()

# One precompiled header with the LibTorch API, built once by the qkv_pch target and reused
# by every target of the project: a translation unit that parses <torch/torch.h> takes about
# 20 s on a 2-core machine, with the PCH a few seconds.
function(qkv_use_pch target)
  if(QKV_PCH AND TARGET qkv_pch)
    target_precompile_headers(${target} REUSE_FROM qkv_pch)
  endif()
endfunction()

# torch 2.x ships fmt 12 headers in its include folder; spdlog 1.10 needs fmt 9. A target that
# includes spdlog must therefore find spdlog's (and fmt's) include folder before torch's.
function(qkv_spdlog_first target)
  foreach(dep spdlog::spdlog fmt::fmt)
    if(TARGET ${dep})
      target_include_directories(${target} SYSTEM BEFORE PRIVATE
        $<TARGET_PROPERTY:${dep},INTERFACE_INCLUDE_DIRECTORIES>)
    endif()
  endforeach()
endfunction()
