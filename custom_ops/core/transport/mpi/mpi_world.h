// The MPI world: the job MPI started (mpirun, keras-ring-run, Slurm). Control
// messages and data travel on two duplicates of MPI_COMM_WORLD, so neither
// meets the other nor the user's own MPI traffic. The only files of the
// engine that include <mpi.h> are these.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "../world.h"

namespace keras_ring {

// Starts MPI unless someone has (MULTIPLE threads asked, SERIALIZED at
// least needed) and returns the world of MPI_COMM_WORLD. Throws EngineError
// saying why it cannot (MPI finalized already, too low a thread level).
std::unique_ptr<World> NewMpiWorld(std::chrono::milliseconds timeout);

// At process exit: MPI_Finalize, if NewMpiWorld started MPI, unless a peer
// failed to answer within the timeout or this rank's engine failed (Abort):
// MPI_Finalize would wait for that peer. MPICH's launchers take a rank that
// exits without it for a failed one, and end the job.
void FinalizeMpi();

// The version string of the MPI library loaded.
std::string MpiLibraryVersion();

}  // namespace keras_ring
