;;;; What a worker of the readiness engine serves with, in one object made
;;;; once per worker thread: its buffer, the readiness set, the acceptor's
;;;; request and reply constructors, the buffer replies are built in.  The
;;;; request cycle passes it as an argument; the code Hunchentoot calls back
;;;; into (PROCESS-REQUEST and the reply) finds it in *SERVING*.

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (serving (:constructor %make-serving))
  "A worker's means of serving the connections of one run of the engine."
  (engine nil :type readiness-engine :read-only t)
  ;; The pool's WORKER record of the thread.
  (worker nil :read-only t)
  ;; The engine's READINESS-SET of this run, and its MEMORY-BUDGET.
  (set nil :type readiness-set :read-only t)
  (budget nil :type memory-budget :read-only t)
  (acceptor nil :read-only t)
  ;; The acceptor's settings the request cycle reads at every request,
  ;; asked once a run as the buffer's size is (HEAD-BUFFER-BYTES): each
  ;; was a generic call a request (bench/profiles/2026-12-04-settings-a-run.txt).
  ;; ACCEPTOR-HTTP2-P, whether ACCEPTOR-ACCESS-LOG-FORMAT is :JSON,
  ;; ACCEPTOR-MAX-HEADER-BYTES, ACCEPTOR-MAX-BODY-BYTES and
  ;; ACCEPTOR-COMPRESSION.
  (http2-p nil :read-only t)
  (access-log-json-p nil :read-only t)
  (max-header-bytes 0 :type fixnum :read-only t)
  (max-body-bytes nil :read-only t)
  (compression nil :type list :read-only t)
  ;; Where heads are read and the next request's octets moved to.  It holds
  ;; other clients' octets: it is never an argument a handler's backtrace
  ;; could show.
  (buffer nil :type octets :read-only t)
  ;; The REPLY-HEAD replies are built in.
  (reply-head (make-reply-head) :type reply-head :read-only t)
  ;; The worker's compressors (reply-coding.lisp), made at its first coded
  ;; reply, freed when it ends; NIL until then.
  (coders nil)
  ;; The string header names are spelled in (MAKE-NAME-SCRATCH).
  (name-scratch (make-name-scratch) :read-only t)
  ;; The REQUEST-HEAD each request's head is parsed into.
  (request-head (make-request-head) :type request-head :read-only t)
  ;; The engine's OBJECT-CONSTRUCTORS of this run.
  (constructors nil :type object-constructors :read-only t)
  ;; What the Keep-Alive header says: timeout= the whole seconds a
  ;; kept-alive connection stays open (the acceptor's KEEP-ALIVE-TIMEOUT);
  ;; and its octets (HEADER-TEXT-OCTETS).
  (keep-alive-header-value "" :type string :read-only t)
  (keep-alive-header-octets nil :read-only t)
  ;; The acceptor's server name, asked once: Hunchentoot formats it anew at
  ;; every call.  And its octets (HEADER-TEXT-OCTETS).
  (server-header-value nil :read-only t)
  (server-header-octets nil :read-only t)
  ;; The stripe of the set's counters this worker counts its requests in.
  (counter-stripe 0 :type fixnum :read-only t)
  ;; Where the acceptor keeps Hunchentoot's count of requests in progress
  ;; (REQUESTS-IN-PROGRESS-LOCATION): counted there by compare-and-swap.
  (requests-in-progress-location nil :read-only t)
  ;; While a request on a plain connection is answered, that CONNECTION: a
  ;; reply written as pieces may then be left to the engine.  NIL otherwise.
  (reply-connection nil)
  ;; True once SEND-REPLY-PIECES has sent the current request's reply on
  ;; REPLY-CONNECTION's socket itself: the connection's stream then holds no
  ;; output to finish.
  (reply-sent-p nil)
  ;; The worker's REPLY-BATCH (reply-batch.lisp).
  (reply-batch nil :read-only t)
  ;; The engine's PLAIN-STREAMS-RESET-P of this run.
  (plain-streams-reset-p t :read-only t)
  ;; DEFAULT-ACCESS-LOG-P's last answer for this worker's acceptor, and
  ;; HUNCHENTOOT:ACCEPTOR-LOG-ACCESS's methods list it was given for.
  (access-log-methods nil)
  (access-log-answer nil)
  ;; The REPLY-HEAD access log entries are built in; the last destination
  ;; an entry was written to and its ACCESS-LOG (FIND-ACCESS-LOG).
  (log-entry (make-reply-head) :type reply-head :read-only t)
  (access-log-destination nil)
  (access-log nil)
  ;; A function of a function, called within +ACCESS-LOG-FLUSH-MILLISECONDS+
  ;; by a worker of the set.
  (schedule-log-write nil :type function :read-only t)
  ;; PLAIN-HEADER-METHODS-P's last answer, and the methods lists of (SETF
  ;; HUNCHENTOOT:HEADER-OUT) and HUNCHENTOOT:HEADERS-OUT it was given for.
  (header-setter-methods nil)
  (header-reader-methods nil)
  (plain-header-methods-answer nil)
  ;; The DEFERRED-REPLY the handler of the request being answered made
  ;; (DEFER-REPLY), or NIL.
  (deferred nil)
  ;; While the worker calls the timers due, the connections whose deferred
  ;; reply they completed, taken, for it to serve next (COMPLETE-REPLY);
  ;; :UNUSED otherwise.
  (completed :unused)
  ;; The EVENT-STREAM the handler of the request being answered made its
  ;; reply (START-EVENT-STREAM), or NIL.
  (event-stream nil)
  ;; The engine's refusal of what that handler asked, a REPLY-NOT-DEFERRABLE
  ;; (in an HTTP/2 stream's handler a client may make one at every
  ;; request): logged as its one line, without the backtrace; or NIL.
  (refusal nil)
  ;; The WEBSOCKET-UPGRADE of the request being answered once its
  ;; handshake has been accepted, until the connection becomes the
  ;; websocket; NIL otherwise.
  (upgrade nil))

(defstruct (websocket-upgrade (:constructor make-websocket-upgrade (resource client deflate-window-bits)))
  "A websocket handshake accepted, its 101 not sent yet: the resource and
the client made for it, and the server's window bits when permessage-deflate
was agreed, else NIL."
  (resource nil :read-only t)
  (client nil :read-only t)
  (deflate-window-bits nil :read-only t))

(defmethod print-object ((serving serving) stream)
  ;; Backtraces print it: never the buffer, which holds other clients' octets.
  (print-unreadable-object (serving stream :type t :identity t)))

(defvar *serving* nil
  "In a worker of the readiness engine, its SERVING; NIL elsewhere.")

(defun begin-request-state (serving reply-connection)
  "Forget what the worker's last request left on SERVING -- its upgrade,
deferred reply, event stream, refusal, and whether its reply was sent --
before a request is answered or a deferred reply is sent: each reply
depends on its own request alone.  REPLY-CONNECTION: see the slot."
  (setf (serving-reply-connection serving) reply-connection
        (serving-reply-sent-p serving) nil
        (serving-upgrade serving) nil
        (serving-deferred serving) nil
        (serving-event-stream serving) nil
        (serving-refusal serving) nil))

(defun head-buffer-bytes (acceptor)
  "A worker's buffer takes the largest head allowed, with room to spare for
pipelined requests."
  (max 32768 (+ +max-request-line-bytes+ (acceptor-max-header-bytes acceptor) 1024)))

(defun reply-compression (acceptor)
  "ACCEPTOR-COMPRESSION of ACCEPTOR, from the worker's SERVING when ACCEPTOR
is its acceptor."
  (let ((serving *serving*))
    (if (and serving (eq acceptor (serving-acceptor serving)))
        (serving-compression serving)
        (acceptor-compression acceptor))))

(defun plain-streams-reset-p (acceptor)
  "False when the only HUNCHENTOOT:RESET-CONNECTION-STREAM method for
ACCEPTOR and a plain connection's stream is Hunchentoot's, which returns
a stream that is not chunked as it is: the request cycle then need not
call it on such a stream (where it would be the first to touch the stream
since the request began, a cache miss at each)."
  (let ((methods (applicable-methods #'hunchentoot:reset-connection-stream
                                     (class-of acceptor) (fd-stream-class))))
    (not (equal methods
                (list (find-method #'hunchentoot:reset-connection-stream '()
                                   (list (find-class 'hunchentoot:acceptor) (find-class t))))))))
