;;;; Taking connections from the listening socket, with their addresses,
;;;; and starting their streams: on an SSL acceptor, the TLS handshake.

(in-package #:hunchentoot-recycling-taskmaster)

(defun note-accept-failed (engine set condition)
  "accept(2) failed with CONDITION.  EMFILE and the like last until
connections close: pause accepting until the next sweep, as nginx turns its
accept events off for a moment, and log it (quiet while stopping)."
  ;; Once accepting has stopped, a worker woken just before may find the
  ;; socket no longer listening (REFUSE-CONNECTIONS): nothing to report.
  (unless (or (stopping-p set) (readiness-set-accepting-stopped-p set))
    (call-with-spare-descriptor
     set (lambda ()
           (log-safely (engine-acceptor engine) :error "accept failed, accepting paused for a moment: ~A"
                       condition))))
  (pause-accepting set))

(defun accepted-connection-addresses (set fd peer-address peer-port)
  "The addresses of the connection FD accepted from SET's listening socket
from PEER-ADDRESS and PEER-PORT, as Hunchentoot's request holds them; our
end's asked of FD only when the socket listens on every address.  NIL when
they cannot be told."
  (and peer-address
       (let ((local-address (or (readiness-set-local-address set)
                                (ignore-errors (multiple-value-list (socket-address fd :local))))))
         (and local-address (list* peer-address peer-port local-address)))))

(defun accept-new-connection (engine set)
  "A new CONNECTION from SET's listening socket, :ACTIVE, with its
addresses, or NIL."
  (multiple-value-bind (fd peer-address peer-port)
      (handler-case (accept-connection-fd (readiness-set-listen-fd set))
        (error (condition)
          (note-accept-failed engine set condition)
          (return-from accept-new-connection nil)))
    ;; Another worker may accept the next connection while this one serves.
    (rearm-listen-socket set)
    (when fd
      (atomic-increment (connection-counters-accepted (readiness-set-counters set)))
      (let ((connection (add-connection set fd (make-connection-fd-stream
                                                fd (hunchentoot:acceptor-read-timeout (engine-acceptor engine))))))
        (setf (connection-head-started connection) (get-internal-real-time)
              (connection-addresses connection) (accepted-connection-addresses set fd peer-address peer-port))
        connection))))

(defun take-queued-connections (engine set deadline)
  "Accept each connection the kernel has queued on SET's listening socket,
until none is left or DEADLINE (internal real time) passes, and park each
for its first request as a worker would: a soft STOP serves them before
the socket stops listening."
  (loop while (< (get-internal-real-time) deadline)
        do (let ((connection (accept-new-connection engine set)))
             (if connection
                 (park-or-end set connection #() 0)
                 (return)))))

(defun start-connection-stream (engine connection)
  "Start the new CONNECTION's stream, after asking its addresses of the
socket if its accepting could not tell them.  On an SSL
acceptor that is the TLS handshake: taken by the engine as far as the
client's bytes allow (tls-handshake.lisp), or else inside
HUNCHENTOOT:INITIALIZE-CONNECTION-STREAM, waited for by the worker, bounded
by the read timeout and cut by STOP.  Returns T when CONNECTION can be
served; :INPUT or :OUTPUT when its handshake waits for the socket to be
readable or writable; NIL when the client has gone, the handshake failed or
the pool is stopping."
  (let ((addresses (or (connection-addresses connection)
                       (ignore-errors (connection-addresses-of (connection-fd connection))))))
    (when (and addresses (not (stopping-p (engine-readiness-set engine))))
      (setf (connection-addresses connection) addresses)
      (let* ((certificates (engine-certificates engine))
             (stream (if certificates
                         (continue-connection-handshake (engine-readiness-set engine) certificates connection)
                         (ignore-errors
                          (hunchentoot:initialize-connection-stream (engine-acceptor engine)
                                                                    (connection-fd-stream connection))))))
        (cond ((streamp stream)
               (setf (connection-stream connection) stream
                     (connection-usocket connection) (make-connection-socket
                                                      connection (connection-fd-stream connection)))
               t)
              (t stream))))))
