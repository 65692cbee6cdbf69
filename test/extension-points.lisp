;;;; Hunchentoot's connection-level extension points, the way hunchensocket
;;;; and Clack use them, with identical expectations on Hunchentoot's
;;;; EASY-ACCEPTOR and ours: a PROCESS-CONNECTION :AROUND method binding the
;;;; socket for the handler, a handler that upgrades the connection and
;;;; then speaks its own protocol on the socket's stream, DETACH-SOCKET,
;;;; and a handler's warnings in the message log.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite extension-points :in all
  :description "PROCESS-CONNECTION :AROUND, connection upgrades, DETACH-SOCKET, warnings.")
(in-suite extension-points)

(defvar *mixin-socket* nil
  "The socket PROCESS-CONNECTION was called with, bound by SOCKET-BINDING-MIXIN
as hunchensocket binds *WEBSOCKET-SOCKET* and Clack *CLIENT-SOCKET*.")

(defclass socket-binding-mixin () ()
  (:documentation "Binds *MIXIN-SOCKET* around HUNCHENTOOT:PROCESS-CONNECTION."))

(defmethod ht:process-connection :around ((acceptor socket-binding-mixin) socket)
  (let ((*mixin-socket* socket))
    (call-next-method)))

(defclass echo-request (ht:request) ()
  (:documentation "A request whose PROCESS-REQUEST :AFTER method takes the
connection over when the handler answered 101, as hunchensocket's does."))

(defun read-octet-line (stream)
  "The octets of STREAM up to the next LF, as a string; NIL at end of file."
  (let ((octets (loop for octet = (read-byte stream nil)
                      while (and octet (/= octet 10))
                      collect octet
                      finally (unless octet (return-from read-octet-line nil)))))
    (map 'string #'code-char octets)))

(defun write-octet-line (stream text)
  (write-sequence (map '(vector (unsigned-byte 8)) #'char-code (format nil "~A~C" text #\Linefeed)) stream)
  (finish-output stream))

(defmethod ht:process-request :after ((request echo-request))
  "After a 101, echo each line the client sends on the socket's stream until
it says bye."
  (when (= 101 (ht:return-code*))
    (let ((stream (usocket:socket-stream *mixin-socket*)))
      (finish-output stream)
      (loop for line = (read-octet-line stream)
            until (or (null line) (string= line "bye"))
            do (write-octet-line stream (format nil "echo ~A" line))))))

;;; After a handler gives an upgraded or detached connection back, each
;;; acceptor waits for a next request on it: Hunchentoot's for its read
;;; timeout (20 s by default), ours for its keep-alive timeout (5 s).
;;; Shorter ones here end those waits, and the tests, sooner.

(defclass mixin-easy-acceptor (socket-binding-mixin ht:easy-acceptor) ()
  (:default-initargs :request-class 'echo-request :read-timeout 2 :write-timeout 2))

(defclass mixin-parallel-acceptor (socket-binding-mixin parallel-easy-acceptor) ()
  (:default-initargs :request-class 'echo-request :keep-alive-timeout 1))

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defparameter *mixin-acceptor-classes* '(mixin-easy-acceptor mixin-parallel-acceptor)))

(ht:define-easy-handler (test-mixin-socket :uri "/test/mixin/socket") ()
  (setf (ht:content-type*) "text/plain")
  (format nil "~:[unbound~;bound~] ~:[no-stream~;stream~] ~:[other-port~;same-port~]"
          *mixin-socket*
          (and *mixin-socket* (streamp (usocket:socket-stream *mixin-socket*)))
          (and *mixin-socket* (eql (usocket:get-peer-port *mixin-socket*) (ht:remote-port*)))))

(ht:define-easy-handler (test-mixin-upgrade :uri "/test/mixin/upgrade") ()
  (setf (ht:return-code*) 101
        (ht:header-out :upgrade) "echo"
        (ht:header-out :connection) "Upgrade")
  "")

(ht:define-easy-handler (test-mixin-detach :uri "/test/mixin/detach") ()
  (setf (ht:content-type*) "text/plain")
  (let ((stream (usocket:socket-stream *mixin-socket*)))
    (ht:detach-socket ht:*acceptor*)
    (bt:make-thread (lambda ()
                      ;; After the reply below has gone out.
                      (sleep 0.3)
                      (write-octet-line stream "late")
                      (close stream))
                    :name "detached connection writer"))
  "detached")

(define-http-test mixin.around-method-binds-the-socket-for-the-handler (:classes *mixin-acceptor-classes*)
  (is (equal '(200 "bound stream same-port")
             (multiple-value-list (http-get *server* "/test/mixin/socket"))))
  (is (equal "bound stream same-port" (nth-value 1 (http-get *server* "/test/mixin/socket")))
      "and again on the next connection"))

(defun read-head (stream)
  "The head of a response read from STREAM up to its blank line, as a string."
  (let ((octets '()))
    (loop until (and (>= (length octets) 4) (equal (subseq octets 0 4) '(10 13 10 13)))
          do (push (read-byte stream) octets))
    (map 'string #'code-char (reverse octets))))

(define-http-test mixin.upgraded-connection-speaks-its-own-protocol (:classes *mixin-acceptor-classes*)
  (let ((socket (connect *server*)))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           (send-text socket (crlf-lines "GET /test/mixin/upgrade HTTP/1.1" "Host: localhost"
                                         "Connection: Upgrade" "Upgrade: echo" ""))
           (is (eql 0 (search "HTTP/1.1 101" (read-head stream))))
           ;; Three seconds of messages, while other clients are served.
           (dotimes (i 6)
             (write-octet-line stream (format nil "message ~D" i))
             (is (equal (format nil "echo message ~D" i) (read-octet-line stream)))
             (is (eql 200 (http-get *server* "/test/yo")) "another client is served meanwhile")
             (sleep 0.5))
           (write-octet-line stream "bye")
           (is (null (read-byte stream nil)) "the connection ends after bye"))
      (usocket:socket-close socket))))

(define-http-test mixin.detached-socket-is-the-handlers (:classes *mixin-acceptor-classes*)
  (let ((socket (connect *server*)))
    (unwind-protect
         (progn
           (send-text socket (crlf-lines "GET /test/mixin/detach HTTP/1.1" "Host: localhost" ""))
           (multiple-value-bind (status body) (read-response socket)
             (is (eql 200 status))
             (is (equal "detached" body)))
           (let ((stream (usocket:socket-stream socket)))
             (is (equal "late" (read-octet-line stream)) "the handler's thread writes on")
             (is (null (read-byte stream nil)) "and closes the connection itself")))
      (usocket:socket-close socket))
    (is (eql 200 (http-get *server* "/test/yo")))))

(defclass stream-reset-counting-mixin ()
  ((resets :initform 0 :accessor stream-resets
           :documentation "How many times HUNCHENTOOT:RESET-CONNECTION-STREAM ran."))
  (:documentation "Counts the resets of the connection stream, as a mixin that
checks or swaps that stream between requests sees them."))

(defmethod ht:reset-connection-stream :after ((acceptor stream-reset-counting-mixin) stream)
  (declare (ignore stream))
  (incf (stream-resets acceptor)))

(defclass reset-counting-easy-acceptor (stream-reset-counting-mixin ht:easy-acceptor) ())

(defclass reset-counting-parallel-acceptor (stream-reset-counting-mixin parallel-easy-acceptor) ())

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defparameter *reset-counting-acceptor-classes*
    '(reset-counting-easy-acceptor reset-counting-parallel-acceptor)))

(define-http-test mixin.stream-reset-after-each-request (:classes *reset-counting-acceptor-classes*)
  ;; The reset comes after the reply has gone: hence the wait.
  (let ((socket (connect *server*)))
    (unwind-protect
         (dotimes (i 3)
           (send-text socket (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" ""))
           (is (eql 200 (read-response socket)))
           (is (wait-until (lambda () (eql (1+ i) (stream-resets *server*))) :timeout 5)
               "~D resets after ~D requests on one connection" (stream-resets *server*) (1+ i)))
      (usocket:socket-close socket))))

(test mixin.stream-reset-left-out-only-when-hunchentoots-alone
  (is (not (hrt::plain-streams-reset-p (make-instance 'parallel-easy-acceptor)))
      "Hunchentoot's method alone returns a plain stream as it is")
  (is (hrt::plain-streams-reset-p (make-instance 'reset-counting-parallel-acceptor))
      "another method is called"))

(defclass access-logging-parallel-acceptor (parallel-easy-acceptor) ()
  (:documentation "An acceptor on which a test defines an access log method while it serves."))

(defvar *access-log-calls* 0)

(test logging.access-log-method-defined-while-serving-is-called
  ;; With no destination, the access log call is left out while only
  ;; Hunchentoot's method would answer it; a method defined at the REPL on
  ;; a running server is called from its next request on.
  (with-server (server (make-server 'access-logging-parallel-acceptor))
    (setf *access-log-calls* 0)
    (is (eql 200 (http-get server "/test/yo")))
    (let ((method (eval '(defmethod ht:acceptor-log-access :after ((acceptor access-logging-parallel-acceptor)
                                                                   &key return-code)
                          (when (eql return-code 200)
                            (incf *access-log-calls*))))))
      (unwind-protect
           (progn
             (is (eql 200 (http-get server "/test/yo")))
             (is (wait-until (lambda () (eql 1 *access-log-calls*)) :timeout 5)
                 "~D calls after one request" *access-log-calls*))
        (remove-method #'ht:acceptor-log-access method))
      (is (eql 200 (http-get server "/test/yo")))
      (is (eql 1 *access-log-calls*) "removed, the method is not called"))))

(defgeneric methods-list-probe (thing)
  (:documentation "A generic function whose methods a test adds and removes."))

(defclass methods-list-probe-class (standard-generic-function) ()
  (:metaclass sb-mop:funcallable-standard-class)
  (:documentation "A generic function class of a user's, whose methods are read through the generic reader."))

(test methods-list.new-list-with-each-method-added-or-removed
  ;; A worker keeps an answer while the list it read stays the same list.
  (dolist (generic-function (list #'methods-list-probe
                                  (make-instance 'methods-list-probe-class :lambda-list '(thing))))
    (let ((before (hrt::generic-function-methods-list generic-function)))
      (is (eq (sb-mop:generic-function-methods generic-function) before))
      (let ((method (make-instance 'standard-method :qualifiers '() :lambda-list '(thing)
                                                    :specializers (list (find-class 'integer))
                                                    :function (lambda (arguments next-methods)
                                                                (declare (ignore next-methods))
                                                                (first arguments)))))
        (add-method generic-function method)
        (let ((added (hrt::generic-function-methods-list generic-function)))
          (is (not (eq before added)))
          (is (eq (sb-mop:generic-function-methods generic-function) added))
          (is (member method added))
          (remove-method generic-function method)
          (let ((removed (hrt::generic-function-methods-list generic-function)))
            (is (not (eq added removed)))
            (is (not (member method removed)))
            (is (eq (sb-mop:generic-function-methods generic-function) removed))))))))

(ht:define-easy-handler (test-warn :uri "/test/warn") ()
  (warn "A warning from a handler, on purpose.")
  "warned")

(test warnings.reach-the-message-log
  (dolist (class '(ht:easy-acceptor parallel-easy-acceptor))
    (with-thread-leak-check ()
      (let ((log (make-string-output-stream)))
        (with-server (server (make-server class :message-log-destination log))
          (let ((*error-output* (make-broadcast-stream)))
            (is (eql 200 (http-get server "/test/warn")) "~S answers" class)))
        (is (search "A warning from a handler, on purpose." (get-output-stream-string log))
            "~S logs the handler's warning" class)))))

(defun shows-secret-p (text)
  "True when TEXT shows the secret of the test below, as characters or as the
octets of a printed buffer (S is 83)."
  (or (search "SSSSSSSSSS" text) (search "83 83 83 83 83 83" text)))

(defmacro with-hunchentoot-setting ((variable value) &body body)
  "Run BODY with Hunchentoot's global VARIABLE set to VALUE in every thread."
  (let ((old (gensym "OLD")))
    `(let ((,old ,variable))
       (setf ,variable ,value)
       (unwind-protect (progn ,@body)
         (setf ,variable ,old)))))

(test logging.handler-error-shows-no-other-clients-bytes
  ;; One worker reads a client's long head into its buffer, then serves a
  ;; failing handler for another client; the backtrace in the log and on
  ;; the error page must not print that buffer.
  (let ((log (make-string-output-stream))
        (secret (make-string 3000 :initial-element #\S)))
    (with-thread-leak-check ()
      (with-hunchentoot-setting (ht:*show-lisp-errors-p* t)
        (with-hunchentoot-setting (ht:*show-lisp-backtraces-p* t)
          (with-server (server (make-server 'parallel-easy-acceptor
                                            :message-log-destination log
                                            :taskmaster (make-instance 'recycling-taskmaster
                                                                       :standby-thread-count 1
                                                                       :max-thread-count 1)))
            (let ((socket (connect server)))
              (send-text socket (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost"
                                            (format nil "Cookie: session=~A" secret) ""))
              (is (eql 200 (read-response socket)))
              (usocket:socket-close socket))
            (multiple-value-bind (status page) (http-get server "/test/error")
              (is (eql 500 status))
              (is (search "This handler fails on purpose." page) "the page shows the error")
              (is (not (shows-secret-p page)) "the error page holds no other client's bytes")
              (is (< (length page) 10240) "the error page is ~D characters" (length page)))))))
    (let ((text (get-output-stream-string log)))
      (is (search "This handler fails on purpose." text) "the error is logged")
      (is (not (shows-secret-p text)) "the log holds no other client's bytes")
      (is (< (length text) 10240) "the log entry is ~D characters" (length text)))))

;;; Easy handlers found by the index (easy-handler-index.lisp): whatever it
;;; answers is what Hunchentoot's DISPATCH-EASY-HANDLERS answers.

(defun request-for-path (path &optional (host "localhost"))
  "A request object with only its path and Host header, as the dispatchers read them."
  (let ((request (allocate-instance (find-class 'ht:request))))
    (setf (slot-value request 'ht::script-name) path
          (slot-value request 'ht::headers-in) (list (cons :host host)))
    request))

(defun index-answers (alist paths)
  "For each of PATHS: the index's answer and Hunchentoot's, with ALIST the easy handlers."
  (let* ((acceptor (make-instance 'parallel-easy-acceptor :name :a))
         (ht:*acceptor* acceptor)
         (ht::*easy-handler-alist* alist))
    (loop for path in paths
          for request = (request-for-path path)
          collect (list path (hrt::indexed-easy-handler acceptor request) (ht:dispatch-easy-handlers request)))))

(test easy-handlers.index-answers-as-hunchentoot
  (let ((paths '("/x" "/y" "/z" "/w" "/v" "/nope" "/X" "")))
    ;; Only paths: the index answers every one Hunchentoot finds.
    (loop for (path ours theirs) in (index-answers (list (list "/x" t 'h1) (list "/y" '(:a) 'h2) (list "/y" t 'h3)
                                                         (list "/z" '(:b) 'h4) (list "/w" t 'h6) (list "/x" t 'h7)
                                                         (list "/z" t 'h8))
                                                   paths)
          do (is (eq ours theirs) "~S: the index found ~S, Hunchentoot ~S" path ours theirs))
    ;; A predicate and a host before some: those are left to Hunchentoot.
    (loop for (path ours theirs) in (index-answers (list (list "/x" t 'h1)
                                                         (list (lambda (request) (equal (ht:script-name request) "/w")) t 'h5)
                                                         (list "/w" t 'h6) (list "/v" t 'h9 "elsewhere.example")
                                                         (list "/v" t 'h10) (list "/z" '(:b) 'h4))
                                                   paths)
          do (is (or (null ours) (eq ours theirs)) "~S: the index found ~S, Hunchentoot ~S" path ours theirs)
             (when (equal path "/x")
               (is (eq 'h1 ours) "a path before the predicate is found by the index")))))

(test easy-handlers.index-follows-changes-to-the-list
  (let* ((alist (list (list "/x" t 'h1) (list "/y" t 'h2) (list "/z" t 'h3)))
         (acceptor (make-instance 'parallel-easy-acceptor :name :a))
         (ht:*acceptor* acceptor)
         (ht::*easy-handler-alist* alist))
    (flet ((found (path) (hrt::indexed-easy-handler acceptor (request-for-path path))))
      (is (eq 'h2 (found "/y")))
      ;; Deleted in place, the list's head the same.
      (setf ht::*easy-handler-alist* (delete "/y" alist :key #'first :test #'equal))
      (is (eq alist ht::*easy-handler-alist*))
      (is (null (found "/y")) "a deleted handler is not found")
      (is (eq 'h3 (ht:dispatch-easy-handlers (request-for-path "/z"))))
      (is (member (found "/z") '(nil h3)))
      ;; An entry's path changed in place.
      (setf (first (first alist)) "/moved")
      (is (null (found "/x")) "a handler whose path changed is not found by its old path")
      (is (member (found "/moved") '(nil h1)) "nor by its new one but as Hunchentoot finds it")
      ;; A handler defined again in front, as DEFINE-EASY-HANDLER does.
      (push (list "/z" t 'h4) ht::*easy-handler-alist*)
      (is (eq 'h4 (found "/z"))))))

(ht:define-easy-handler (test-indexed :uri "/test/indexed") ()
  ;; Defined after every handler whose path is a predicate: the index finds it.
  (setf (ht:content-type*) "text/plain")
  "indexed")

(defun index-finds-p (path)
  "True when a PARALLEL-EASY-ACCEPTOR's index finds a handler for PATH."
  (let ((ht:*acceptor* (make-instance 'parallel-easy-acceptor)))
    (hrt::indexed-easy-handler ht:*acceptor* (request-for-path path))))

(defclass routes-first-acceptor (ht:easy-acceptor) ()
  (:documentation "Answers /test/indexed itself, before the easy handlers, as a router mixin would."))

(defmethod ht:acceptor-dispatch-request ((acceptor routes-first-acceptor) request)
  (if (equal (ht:script-name request) "/test/indexed") "routed first" (call-next-method)))

(defclass parallel-routes-first-acceptor (parallel-easy-acceptor routes-first-acceptor) ()
  (:documentation "A mixin whose dispatch method falls between the index's and Hunchentoot's easy one."))

(test easy-handlers.mixin-method-between-dispatches-first
  (let ((class (find-class 'parallel-routes-first-acceptor)))
    (sb-mop:finalize-inheritance class)
    (is (member (find-class 'routes-first-acceptor)
                (member (find-class 'hrt::indexed-easy-handlers) (sb-mop:class-precedence-list class)))
        "the mixin comes after the index in the precedence list"))
  (is-true (index-finds-p "/test/indexed"))
  (with-server (server (make-server 'parallel-routes-first-acceptor))
    (is (equal "routed first" (nth-value 1 (http-get server "/test/indexed"))))
    (is (eql 200 (http-get server "/test/yo")) "the easy handlers still answer the rest")))

(defun test-shadowing-dispatcher-page ()
  "shadowed")

(test easy-handlers.other-dispatchers-and-methods-first
  (is-true (index-finds-p "/test/indexed"))
  (with-server (server (make-server 'parallel-easy-acceptor))
    (is (equal "indexed" (nth-value 1 (http-get server "/test/indexed"))))
    ;; A dispatcher put before the easy handlers' is asked first.
    (let ((table ht:*dispatch-table*))
      (unwind-protect
           (progn
             (setf ht:*dispatch-table*
                   (cons (ht:create-prefix-dispatcher "/test/indexed" 'test-shadowing-dispatcher-page) table))
             (is (equal "shadowed" (nth-value 1 (http-get server "/test/indexed")))))
        (setf ht:*dispatch-table* table)))
    ;; A dispatch method defined while serving runs before the easy handlers.
    (let ((method (eval '(defmethod ht:acceptor-dispatch-request ((acceptor parallel-easy-acceptor) request)
                          (if (equal (ht:script-name request) "/test/indexed") "from a method" (call-next-method))))))
      (unwind-protect
           (is (equal "from a method" (nth-value 1 (http-get server "/test/indexed"))))
        (remove-method #'ht:acceptor-dispatch-request method)))
    (is (equal "indexed" (nth-value 1 (http-get server "/test/indexed"))))))
