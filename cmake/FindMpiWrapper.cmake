# Finds the MPI that keras-ring builds against from its C++ compiler wrapper:
# $KERAS_RING_MPICXX if set (a system MPI), else the `mpicxx` of the PyPI
# `mpich` package that pip installs into the build environment.
#
# Sets MPI_WRAPPER, MPI_INCLUDE_DIRS, MPI_LIBRARY_DIRS, MPI_LIBRARIES,
# MPI_VENDOR ("MPICH", "Open MPI", "Intel MPI", "unknown") and MPI_SOURCE
# ("system" or "pypi-mpich"). We parse the wrapper's own flags instead of
# using FindMPI so that the wrapper's rpath (a temporary build environment)
# never ends up in our libraries; we set our own.

if(DEFINED ENV{KERAS_RING_MPICXX} AND NOT "$ENV{KERAS_RING_MPICXX}" STREQUAL "")
  set(MPI_WRAPPER "$ENV{KERAS_RING_MPICXX}")
  set(MPI_SOURCE "system")
else()
  find_program(MPI_WRAPPER NAMES mpicxx mpic++ NO_CACHE)
  set(MPI_SOURCE "pypi-mpich")
endif()
if(NOT MPI_WRAPPER OR NOT EXISTS "${MPI_WRAPPER}")
  message(FATAL_ERROR
    "keras-ring: no MPI C++ compiler wrapper found (looked for "
    "KERAS_RING_MPICXX='$ENV{KERAS_RING_MPICXX}', then mpicxx on PATH). The default build uses "
    "the PyPI 'mpich' package, which pip installs into the build environment; to build against "
    "a system MPI set KERAS_RING_MPICXX=/path/to/mpicxx.")
endif()

# MPICH and Intel MPI print their command line with -show, Open MPI with --showme.
execute_process(COMMAND "${MPI_WRAPPER}" -show OUTPUT_VARIABLE _kr_show RESULT_VARIABLE _kr_rc
                ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _kr_rc EQUAL 0)
  execute_process(COMMAND "${MPI_WRAPPER}" --showme OUTPUT_VARIABLE _kr_show RESULT_VARIABLE _kr_rc
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
endif()
if(NOT _kr_rc EQUAL 0)
  message(FATAL_ERROR "keras-ring: '${MPI_WRAPPER} -show' and '--showme' both failed; "
                      "is it an MPI compiler wrapper?")
endif()

separate_arguments(_kr_args UNIX_COMMAND "${_kr_show}")
set(MPI_INCLUDE_DIRS "")
set(MPI_LIBRARY_DIRS "")
set(MPI_LIBRARIES "")
foreach(_kr_arg IN LISTS _kr_args)
  if(_kr_arg MATCHES "^-I(.+)")
    list(APPEND MPI_INCLUDE_DIRS "${CMAKE_MATCH_1}")
  elseif(_kr_arg MATCHES "^-L(.+)")
    list(APPEND MPI_LIBRARY_DIRS "${CMAKE_MATCH_1}")
  elseif(_kr_arg MATCHES "^-l(.+)")
    list(APPEND MPI_LIBRARIES "${CMAKE_MATCH_1}")
  endif()
endforeach()

find_file(_kr_mpi_h mpi.h PATHS ${MPI_INCLUDE_DIRS} NO_DEFAULT_PATH NO_CACHE)
if(NOT _kr_mpi_h)
  find_file(_kr_mpi_h mpi.h NO_CACHE)
endif()
if(NOT _kr_mpi_h)
  message(FATAL_ERROR "keras-ring: mpi.h not found for ${MPI_WRAPPER} (include dirs: ${MPI_INCLUDE_DIRS})")
endif()
file(READ "${_kr_mpi_h}" _kr_mpi_h_text)
if(_kr_mpi_h_text MATCHES "I_MPI_VERSION")
  set(MPI_VENDOR "Intel MPI")
elseif(_kr_mpi_h_text MATCHES "MPICH_VERSION")
  set(MPI_VENDOR "MPICH")
elseif(_kr_mpi_h_text MATCHES "OMPI_MAJOR_VERSION")
  set(MPI_VENDOR "Open MPI")
else()
  set(MPI_VENDOR "unknown")
endif()

if(MPI_SOURCE STREQUAL "system")
  get_filename_component(_kr_bin "${MPI_WRAPPER}" DIRECTORY)
  find_program(MPI_MPIEXEC NAMES mpiexec mpirun PATHS "${_kr_bin}" NO_DEFAULT_PATH NO_CACHE)
else()
  set(MPI_MPIEXEC "")
endif()
message(STATUS "keras-ring: MPI ${MPI_VENDOR} from ${MPI_WRAPPER} (${MPI_SOURCE}); "
               "include ${MPI_INCLUDE_DIRS}; libs ${MPI_LIBRARIES} in ${MPI_LIBRARY_DIRS}")
