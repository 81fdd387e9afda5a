#include "hp/core/kernel_observer.h"

namespace hp {
namespace {
thread_local KernelObserver* observer = nullptr;
}  // namespace

KernelObserver* kernel_observer() { return observer; }

KernelObserverGuard::KernelObserverGuard(KernelObserver* next) : previous_(observer) { observer = next; }

KernelObserverGuard::~KernelObserverGuard() { observer = previous_; }

}  // namespace hp
