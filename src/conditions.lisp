(in-package #:hunchentoot-recycling-taskmaster)

(define-condition recycling-taskmaster-error (error)
  ()
  (:documentation "Superclass of every error this library signals."))

(define-condition invalid-configuration (recycling-taskmaster-error)
  ((initarg :initarg :initarg :reader invalid-configuration-initarg
            :documentation "The initarg whose value is impossible.")
   (value :initarg :value :reader invalid-configuration-value
          :documentation "The value given for it.")
   (reason :initarg :reason :reader invalid-configuration-reason
           :documentation "Why the value is impossible, as a sentence."))
  (:report (lambda (condition stream)
             (format stream "Invalid ~A: ~S ~S: ~A"
                     (configuration-subject condition)
                     (invalid-configuration-initarg condition)
                     (invalid-configuration-value condition)
                     (invalid-configuration-reason condition))))
  (:documentation "Signalled by MAKE-INSTANCE when an initarg's value cannot work."))

(defgeneric configuration-subject (condition)
  (:documentation "What CONDITION found misconfigured, for its report."))

(define-condition invalid-taskmaster-configuration (invalid-configuration)
  ()
  (:documentation "Signalled by MAKE-INSTANCE of RECYCLING-TASKMASTER when the
thread counts cannot work together (a negative or non-integer count, or a
standby count above MAX-THREAD-COUNT) or a timeout is not a positive number
of seconds."))

(defmethod configuration-subject ((condition invalid-taskmaster-configuration))
  "RECYCLING-TASKMASTER configuration")

(define-condition invalid-acceptor-configuration (invalid-configuration)
  ()
  (:documentation "Signalled by MAKE-INSTANCE of a PARALLEL-ACCEPTOR for an
unknown :CONNECTION-ENGINE, a timeout that is not a positive number of
seconds, a :WRITE-TIMEOUT other than the :READ-TIMEOUT, an impossible
:MAX-HEADER-BYTES or a :SESSION-STORE that is not one; by HUNCHENTOOT:START
for a :SESSION-STORE with a :REQUEST-CLASS that does not inherit from
PARALLEL-REQUEST."))

(defmethod configuration-subject ((condition invalid-acceptor-configuration))
  "PARALLEL-ACCEPTOR configuration")

(define-condition invalid-static-folder (invalid-configuration)
  ()
  (:documentation "Signalled by CREATE-STATIC-FOLDER-DISPATCHER-AND-HANDLER
for a URI prefix that is not a string ending with a slash, or a base path
that names no existing directory."))

(defmethod configuration-subject ((condition invalid-static-folder))
  "static folder")

(defgeneric refused-certificate-file (condition)
  (:documentation "The certificate file of a CERTIFICATE-NOT-LOADED, as the acceptor was given it."))

(defgeneric refused-key-file (condition)
  (:documentation "The private key file of a CERTIFICATE-NOT-LOADED."))

(defgeneric certificate-refusal-reason (condition)
  (:documentation "Why the files of a CERTIFICATE-NOT-LOADED did not load: a
phrase ending with OpenSSL's reason in parentheses."))

(define-condition certificate-not-loaded (recycling-taskmaster-error cl+ssl:ssl-error-initialize)
  ((certificate-file :initarg :certificate-file :reader refused-certificate-file
                     :documentation "The certificate chain's file, as the acceptor was given it.")
   (key-file :initarg :key-file :reader refused-key-file
             :documentation "The private key's file.")
   (reason :initarg :reason :reader certificate-refusal-reason
           :documentation "Why they did not load, as a phrase with OpenSSL's reason."))
  (:report (lambda (condition stream)
             (format stream "The TLS certificate ~A with the key ~A did not load: ~A."
                     (refused-certificate-file condition) (refused-key-file condition)
                     (certificate-refusal-reason condition))))
  (:documentation "Signalled by START of a PARALLEL-SSL-ACCEPTOR, and by
RELOAD-CERTIFICATES, when a certificate or its key does not load or they do
not belong together.  A replacement found by the engine's own check is
logged instead, and the certificate loaded before is kept.  A
CL+SSL:SSL-ERROR-INITIALIZE, as the engine signalled before it had
certificates of its own."))

(define-condition acceptor-not-parallel-error (recycling-taskmaster-error)
  ((acceptor :initarg :acceptor :reader error-acceptor
             :documentation "The acceptor that was being started."))
  (:report (lambda (condition stream)
             (format stream "RECYCLING-TASKMASTER serves the connection loop of ~
PARALLEL-ACCEPTOR; ~S is not one.  Use PARALLEL-ACCEPTOR, PARALLEL-EASY-ACCEPTOR, ~
PARALLEL-SSL-ACCEPTOR or PARALLEL-EASY-SSL-ACCEPTOR (or a subclass)."
                     (error-acceptor condition))))
  (:documentation "Signalled by HUNCHENTOOT:START when a RECYCLING-TASKMASTER
is given to an acceptor that is not a PARALLEL-ACCEPTOR."))

(define-condition reply-not-deferrable (recycling-taskmaster-error)
  ((reason :initarg :reason :reader refusal-reason
           :documentation "Why the reply cannot be deferred, as a sentence."))
  (:report (lambda (condition stream)
             (format stream "The reply cannot be deferred: ~A" (refusal-reason condition))))
  (:documentation "Signalled by DEFER-REPLY called outside a handler of a
PARALLEL-ACCEPTOR's request, or after the reply's headers were sent."))

(define-condition event-field-refused (recycling-taskmaster-error)
  ((field :initarg :field :reader refused-field
          :documentation "The field: :EVENT or :ID.")
   (value :initarg :value :reader refused-field-value
          :documentation "What it was to be."))
  (:report (lambda (condition stream)
             (format stream "An event's ~(~A~) field may not hold a line break or NUL: ~S"
                     (refused-field condition) (refused-field-value condition))))
  (:documentation "Signalled by SEND-EVENT and PUBLISH for an event name or id
that would end its line early."))

(define-condition message-too-long (recycling-taskmaster-error)
  ((octets :initarg :octets :reader message-octet-count
           :documentation "The octets of the message, in UTF-8.")
   (limit :initarg :limit :reader message-octet-limit
          :documentation "The most a published message may have."))
  (:report (lambda (condition stream)
             (format stream "A published message may have ~D octets at most; this one has ~D."
                     (message-octet-limit condition) (message-octet-count condition))))
  (:documentation "Signalled by PUBLISH for a message over +MAX-PUBLISHED-OCTETS+."))

(define-condition recycling-taskmaster-corrupted-error (recycling-taskmaster-error)
  ((taskmaster :initarg :taskmaster :reader error-taskmaster
               :documentation "The taskmaster whose pool is in doubt.")
   (description :initarg :description :reader corruption-description
                :documentation "What was found, as a sentence."))
  (:report (lambda (condition stream)
             (format stream "The thread pool of ~S is inconsistent: ~A  ~
ABANDON-ACCEPTOR tears it down by force."
                     (error-taskmaster condition)
                     (corruption-description condition))))
  (:documentation "Signalled when the pool's threads do not behave as its
bookkeeping says: workers that outlive HUNCHENTOOT:STOP's deadline, or
workers still alive when the taskmaster is started again.  Signalled with a
restart named ABANDON-ACCEPTOR that calls that function and then returns from
the HUNCHENTOOT:START or HUNCHENTOOT:STOP that found the fault, leaving the
acceptor stopped."))

(define-condition request-body-too-large (chunga:chunga-error)
  ((limit :initarg :limit :reader body-size-limit
          :documentation "The acceptor's MAX-BODY-BYTES."))
  (:report (lambda (condition stream)
             (format stream "The chunked request body is longer than ~D octets."
                     (body-size-limit condition))))
  (:documentation "Signalled while a request body sent with Transfer-Encoding:
chunked is read, when its chunks add up to more than the acceptor's
MAX-BODY-BYTES.  A subtype of CHUNGA:CHUNGA-ERROR and so of STREAM-ERROR.
Unhandled, it has the client answered 413 and the connection closed."))

(define-condition chunked-body-malformed (chunga:chunga-error)
  ((reason :initarg :reason :reader malformed-body-reason
           :documentation "What is wrong with the body, as a phrase."))
  (:report (lambda (condition stream)
             (format stream "The chunked request body is malformed: ~A."
                     (malformed-body-reason condition))))
  (:documentation "Signalled while a request body sent with Transfer-Encoding:
chunked is read, when it breaks RFC 9112's chunked coding (a chunk-size
line without a size, a bare LF, chunk data not followed by CRLF) or a limit
(a chunk size of more than 15 hexadecimal digits, a chunk-size line over
4 KiB, a trailer section over 16 KiB).  A subtype of CHUNGA:CHUNGA-ERROR and
so of STREAM-ERROR.  The connection is closed after the reply."))

(define-condition request-body-not-stored (error)
  ((path :initarg :path :reader body-file-path
         :documentation "The temporary file the body was to go on in.")
   (cause :initarg :cause :reader body-file-error
          :documentation "The FILE-ERROR or STREAM-ERROR that writing it signalled."))
  (:report (lambda (condition stream)
             (format stream "The request body could not be written to ~A: ~A"
                     (body-file-path condition) (body-file-error condition))))
  (:documentation "Signalled by the engine when a request body that outgrew
the acceptor's BODY-BUFFER-BYTES cannot be written to its temporary file in
HUNCHENTOOT:*TMP-DIRECTORY* (which cannot be made, is not writable, or is
full).  The engine handles it: the message is logged, the client answered
500 and the connection closed; the handler never runs."))

(defgeneric refused-header-name (condition)
  (:documentation "The name of the header a HEADER-VALUE-REFUSED refused
(Set-Cookie for a cookie)."))

(define-condition header-value-refused (recycling-taskmaster-error)
  ((name :initarg :name :reader refused-header-name
         :documentation "The header's name (Set-Cookie for a cookie).  Its
value is never kept: it may be a client's bytes that a handler copied."))
  (:report (lambda (condition stream)
             (format stream "The reply header ~A was refused: its value has a CR, LF or NUL, ~
which would end the header line early on the wire (RFC 9112 2.2)."
                     (refused-header-name condition))))
  (:documentation "Signalled when a reply is written under a parallel
acceptor whose header or cookie value, set by a handler, has a CR, LF or
NUL: before any of the reply is sent, and after the header is taken out
of the reply, so that the 500 the request is then answered with (logged
once, as a handler's error is) carries none of it."))

(define-condition invalid-session-store-configuration (invalid-configuration)
  ()
  (:documentation "Signalled by MAKE-POSTGRESQL-SESSION-STORE when no
database is named (by :DATABASE or PGDATABASE) or :MAX-CONNECTIONS is not a
positive integer."))

(defmethod configuration-subject ((condition invalid-session-store-configuration))
  "session store configuration")

(define-condition session-value-not-storable (recycling-taskmaster-error)
  ((key :initarg :key :reader unstorable-session-key
        :documentation "The key symbol of the value.")
   (value-type :initarg :value-type :reader unstorable-session-value-type
               :documentation "The type of the value, as TYPE-OF gives it."))
  (:report (lambda (condition stream)
             (format stream "The session value of ~S, of type ~S, cannot be kept in a shared ~
session store: it takes numbers, characters, strings, interned symbols, and conses ~
and simple vectors of these."
                     (unstorable-session-key condition) (unstorable-session-value-type condition))))
  (:documentation "Signalled when a session whose acceptor has a shared
session store is saved at the end of its request with a value outside the
store's whitelist.  The request is then answered 500, the message logged,
and the store keeps the session as it was before the request."))

(define-condition session-store-unavailable (serious-condition)
  ((store :initarg :store :reader unavailable-session-store
          :documentation "The session store.")
   (reason :initarg :reason :reader session-store-unavailable-reason
           :documentation "What went wrong, as a phrase: no answer in time, or the
store's own error."))
  (:report (lambda (condition stream)
             (format stream "The session store ~A is unavailable: ~A"
                     (unavailable-session-store condition)
                     (session-store-unavailable-reason condition))))
  (:documentation "Signalled when a request's session is needed and its
acceptor's shared session store did not answer within the acceptor's
SESSION-STORE-TIMEOUT, or failed.  A SERIOUS-CONDITION and not an ERROR,
so that Hunchentoot's handling of a handler's errors (a 500) and a
handler's IGNORE-ERRORS let it pass: the parallel acceptor answers the
request 503, and logs one line when an outage begins and one when it
ends, not one per request.  A handler never sees a session it could not
read as no session."))
