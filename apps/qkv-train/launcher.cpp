#include "launcher.h"

#include "stop_signals.h"

#include <spdlog/spdlog.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace qkv_train {

namespace {

// A TCP port that is free now on the loopback interface (the kernel's pick, as torchrun does;
// another program could take it before rank 0 binds it, which the rendezvous then reports).
int free_port() {
  const int socket_fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (socket_fd < 0) throw std::runtime_error(std::string("--nproc: cannot open a socket: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool ok = ::bind(socket_fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(socket_fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(socket_fd);
  if (!ok) throw std::runtime_error(std::string("--nproc: cannot find a free port: ") + std::strerror(error));
  return ntohs(address.sin_port);
}

int exit_status(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

}  // namespace

std::vector<std::string> arguments_without_nproc(int argc, const char* const* argv) {
  std::vector<std::string> arguments;
  for (int i = 0; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--nproc") {
      ++i;  // and its value
      continue;
    }
    if (argument.rfind("--nproc=", 0) == 0) continue;
    arguments.push_back(argument);
  }
  return arguments;
}

int launch_local_job(int nproc, const std::vector<std::string>& arguments, std::chrono::milliseconds grace) {
  const int port = free_port();
  // Each rank gets this environment plus torchrun's variables (replacing any inherited ones).
  const char* replaced[] = {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="};
  std::vector<std::string> inherited;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    bool keep = true;
    for (const char* prefix : replaced) keep = keep && std::strncmp(*entry, prefix, std::strlen(prefix)) != 0;
    if (keep) inherited.emplace_back(*entry);
  }
  std::vector<char*> argv;
  for (const auto& argument : arguments) argv.push_back(const_cast<char*>(argument.c_str()));
  argv.push_back(nullptr);

  // SIGINT and SIGTERM are forwarded to the ranks; each rank starts with the ones this process
  // takes at their defaults (not blocked, as they are here) and takes them as qkv-train does; one
  // ignored here stays ignored there.
  catch_stop_signals();
  posix_spawnattr_t attributes;
  if (const int error = posix_spawnattr_init(&attributes); error != 0) {
    throw std::runtime_error(std::string("--nproc: cannot start the ranks: ") + std::strerror(error));
  }
  const std::unique_ptr<posix_spawnattr_t, int (*)(posix_spawnattr_t*)> destroy_attributes(&attributes,
                                                                                           posix_spawnattr_destroy);
  start_children_with_default_signals(attributes);

  spdlog::info("--nproc {}: starting ranks 0..{} with rendezvous at 127.0.0.1:{}", nproc, nproc - 1, port);
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < nproc; ++rank) {
    std::vector<std::string> environment = inherited;
    environment.push_back("RANK=" + std::to_string(rank));
    environment.push_back("WORLD_SIZE=" + std::to_string(nproc));
    environment.push_back("LOCAL_RANK=" + std::to_string(rank));
    environment.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nproc));
    environment.push_back("MASTER_ADDR=127.0.0.1");
    environment.push_back("MASTER_PORT=" + std::to_string(port));
    std::vector<char*> envp;
    for (auto& entry : environment) envp.push_back(entry.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    // /proc/self/exe: this very program, wherever it was started from.
    if (const int error = posix_spawn(&pid, "/proc/self/exe", nullptr, &attributes, argv.data(), envp.data());
        error != 0) {
      for (const pid_t started : ranks) ::kill(started, SIGKILL);
      for (const pid_t started : ranks) ::waitpid(started, nullptr, 0);
      throw std::runtime_error("--nproc: cannot start rank " + std::to_string(rank) + ": " + std::strerror(error));
    }
    ranks.push_back(pid);
  }

  // Wait for the ranks; the first failure stops the rest.
  int result = 0;
  int running = nproc;
  std::vector<bool> done(ranks.size(), false);
  bool killing = false;  // SIGTERM sent to the survivors; SIGKILL once kill_after passes
  auto kill_after = std::chrono::steady_clock::now();
  int last_forwarded = 0;
  const auto signal_running_ranks = [&](int signal) {
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (!done[i]) ::kill(ranks[i], signal);
    }
  };
  while (running > 0) {
    if (const int signal = stop_signal_received(); signal != 0 && signal != last_forwarded) {
      last_forwarded = signal;
      signal_running_ranks(signal);
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (ranks[i] != pid || done[i]) continue;
        done[i] = true;
        --running;
        const int code = exit_status(status);
        if (code != 0 && result == 0) {
          result = code;
          if (running > 0 && last_forwarded == 0) {
            spdlog::error("--nproc: rank {} exited with status {}; stopping the other ranks", i, code);
            signal_running_ranks(SIGTERM);
            kill_after = std::chrono::steady_clock::now() + grace;
            killing = true;
          }
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    if (killing && std::chrono::steady_clock::now() > kill_after) {
      signal_running_ranks(SIGKILL);
      killing = false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

}  // namespace qkv_train
