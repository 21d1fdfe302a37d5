# Warnings are errors for the project's own code. Third-party headers are
# included as SYSTEM so their warnings do not stop the build.
add_library(r2ccl_warnings INTERFACE)
target_compile_options(r2ccl_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Werror -Wshadow -Wnon-virtual-dtor
    -Wold-style-cast -Wcast-align -Woverloaded-virtual -Wformat=2 -Wimplicit-fallthrough>)
