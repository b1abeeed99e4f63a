package outbox

import (
	"math"
	"math/rand/v2"
	"time"
)

// RetryPolicy decides when a message that failed is tried again.
type RetryPolicy interface {
	// Backoff returns how long to wait before the next attempt, given the
	// number of attempts made so far (1 after the first failure) and the
	// error of the last one.
	Backoff(attempts int, err error) time.Duration
}

// RetryPolicyFunc adapts a function to [RetryPolicy].
type RetryPolicyFunc func(attempts int, err error) time.Duration

// Backoff calls f(attempts, err).
func (f RetryPolicyFunc) Backoff(attempts int, err error) time.Duration { return f(attempts, err) }

// ExponentialBackoff waits Initial after the first failure, then multiplies
// the wait by Multiplier for every further one, up to Max, and spreads each
// wait by a random ±Jitter fraction so that failed batches do not come back
// in lockstep. The jittered wait never exceeds Max.
type ExponentialBackoff struct {
	Initial    time.Duration
	Multiplier float64
	Max        time.Duration
	Jitter     float64
}

// DefaultRetryPolicy is the dispatcher's retry policy unless
// [WithRetryPolicy] says otherwise: one minute, times five each attempt,
// capped at 24 hours, with ±20% jitter (1m, 5m, 25m, ~2h, ~10.4h, 24h, ...).
func DefaultRetryPolicy() ExponentialBackoff {
	return ExponentialBackoff{Initial: time.Minute, Multiplier: 5, Max: 24 * time.Hour, Jitter: 0.2}
}

// Backoff implements [RetryPolicy].
func (b ExponentialBackoff) Backoff(attempts int, _ error) time.Duration {
	if attempts < 1 {
		attempts = 1
	}
	wait := float64(b.Initial) * math.Pow(b.Multiplier, float64(attempts-1))
	if b.Jitter > 0 {
		wait *= 1 + b.Jitter*(2*rand.Float64()-1)
	}
	if max := float64(b.Max); b.Max > 0 && (wait > max || math.IsInf(wait, 0) || math.IsNaN(wait)) {
		wait = max
	}
	if wait < 0 {
		wait = 0
	}
	return time.Duration(wait)
}
