# Install rules and the exported CMake package: find_package(qkv CONFIG) + qkv::qkv.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS qkv EXPORT qkvTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/qkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_BINARY_DIR}/include/qkv/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/qkv)

set(QKV_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/qkv)
install(EXPORT qkvTargets NAMESPACE qkv:: DESTINATION ${QKV_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/qkvConfig.cmake.in
  ${PROJECT_BINARY_DIR}/qkvConfig.cmake INSTALL_DESTINATION ${QKV_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/qkvConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/qkvConfig.cmake ${PROJECT_BINARY_DIR}/qkvConfigVersion.cmake
  DESTINATION ${QKV_CMAKE_DIR})

# The build tree is a package too (as spdlog's): find_package(qkv) with qkv_DIR=<build folder>
# finds the qkvConfig.cmake above and, beside it, the targets of this build.
export(EXPORT qkvTargets NAMESPACE qkv:: FILE ${PROJECT_BINARY_DIR}/qkvTargets.cmake)
