;;;; One HTTP behaviour suite, run with identical expectations against
;;;; Hunchentoot's EASY-ACCEPTOR (and EASY-SSL-ACCEPTOR) and ours.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite http :in all :description "HTTP behaviour, the same for Hunchentoot's acceptors and ours.")
(in-suite http)

;;; Handlers.

(ht:define-easy-handler (test-echo-parameters :uri "/test/params") ()
  (setf (ht:content-type*) "text/plain; charset=utf-8")
  (format nil "~{~A=~A~^&~}"
          (loop for (name . value) in (append (ht:get-parameters*) (ht:post-parameters*))
                collect name collect value)))

(ht:define-easy-handler (test-upload :uri "/test/upload") ()
  (setf (ht:content-type*) "text/plain")
  (destructuring-bind (path file-name content-type) (ht:post-parameter "file")
    (declare (ignore content-type))
    (with-open-file (in path :element-type '(unsigned-byte 8))
      (let ((octets (make-array (file-length in) :element-type '(unsigned-byte 8))))
        (read-sequence octets in)
        (format nil "~A ~D ~D" file-name (length octets) (reduce #'+ octets))))))

(ht:define-easy-handler (test-set-cookie :uri "/test/set-cookie") (value)
  (ht:set-cookie "flavour" :value value :path "/")
  "set")

(ht:define-easy-handler (test-get-cookie :uri "/test/get-cookie") ()
  (or (ht:cookie-in "flavour") "none"))

(ht:define-easy-handler (test-session :uri "/test/session") ()
  (ht:start-session)
  (princ-to-string (setf (ht:session-value 'visits) (1+ (or (ht:session-value 'visits) 0)))))

(ht:define-easy-handler (test-session-reset :uri "/test/session-reset") ()
  (ht:start-session)
  (setf (ht:session-value 'visits) 0)
  "reset")

(ht:define-easy-handler (test-body :uri "/test/body") ()
  (setf (ht:content-type*) "text/plain")
  (let ((body (ht:raw-post-data :force-binary t)))
    (format nil "~D ~D" (length body) (reduce #'+ body))))

(ht:define-easy-handler (test-chunked-reply :uri "/test/chunked-reply") ()
  (setf (ht:content-type*) "text/plain")
  (let ((stream (ht:send-headers)))
    (dotimes (line 100)
      (write-sequence (flex:string-to-octets (format nil "line ~D~%" line)) stream))))

(ht:define-easy-handler (test-remote-port :uri "/test/remote-port") ()
  (princ-to-string (ht:remote-port*)))

(ht:define-easy-handler (test-error :uri "/test/error") ()
  (error "This handler fails on purpose."))

(defparameter *large-body-length* (* 10 1024 1024))

(ht:define-easy-handler (test-large :uri "/test/large") ()
  (setf (ht:content-type*) "application/octet-stream")
  (let ((octets (make-array *large-body-length* :element-type '(unsigned-byte 8))))
    (dotimes (i *large-body-length* octets)
      (setf (aref octets i) (mod i 251)))))

(ht:define-easy-handler (test-utf-8 :uri "/test/utf-8") (name)
  (setf (ht:content-type*) "text/plain; charset=utf-8")
  (format nil "こんにちは、~A" name))

;; Hunchentoot's count of requests in progress, read from its slot: the
;; reader is ACCESSOR-REQUESTS-IN-PROGRESS in 1.2 and
;; ACCEPTOR-REQUESTS-IN-PROGRESS from 1.3.
(defun requests-in-progress (acceptor)
  (slot-value acceptor 'ht::requests-in-progress))

(ht:define-easy-handler (test-requests-in-progress :uri "/test/requests-in-progress") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (requests-in-progress ht:*acceptor*)))

;;; Running every test against every acceptor class.

(defvar *server* nil "The server the current HTTP behaviour test talks to.")

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defparameter *http-acceptor-classes* '(ht:easy-acceptor parallel-easy-acceptor))
  (defparameter *https-acceptor-classes* '(ht:easy-ssl-acceptor parallel-easy-ssl-acceptor)))

(defun make-test-server (class)
  (if (member class *https-acceptor-classes*)
      (multiple-value-bind (certificate key) (certificate-files)
        (make-server class :ssl-certificate-file certificate :ssl-privatekey-file key))
      (make-server class)))

(defmacro define-http-test (name (&key (classes '*http-acceptor-classes*)) &body body)
  "Define NAME.<class> for each acceptor class in CLASSES, each running BODY
with *SERVER* bound to a started server of that class."
  `(progn
     ,@(loop for class in (symbol-value classes)
             collect `(test ,(intern (format nil "~A.~A" name class))
                        (with-thread-leak-check ()
                          (with-server (*server* (make-test-server ',class))
                            ,@body))))))

(define-http-test http.get-parameters ()
  (multiple-value-bind (status body) (http-get *server* "/test/params" :parameters '(("a" . "1") ("b" . "two words")))
    (is (eql 200 status))
    (is (equal "a=1&b=two words" body))))

(define-http-test http.post-parameters ()
  (multiple-value-bind (status body)
      (http-get *server* "/test/params" :method :post :parameters '(("x" . "10") ("y" . "&=")))
    (is (eql 200 status))
    (is (equal "x=10&y=&=" body))))

(define-http-test http.multipart-upload ()
  (let ((path (uiop:with-temporary-file (:stream out :pathname path :keep t
                                         :element-type '(unsigned-byte 8))
                (dotimes (i 100000) (write-byte (mod i 256) out))
                path)))
    (unwind-protect
         (multiple-value-bind (status body)
             (http-get *server* "/test/upload" :method :post :form-data t
                                               :parameters `(("file" ,path :filename "data.bin")))
           (is (eql 200 status))
           (is (equal (format nil "data.bin 100000 ~D" (loop for i below 100000 sum (mod i 256)))
                      body)))
      (delete-file path))))

(define-http-test http.cookies ()
  (let ((jar (make-instance 'drakma:cookie-jar)))
    (is (equal "set" (nth-value 1 (http-get *server* "/test/set-cookie?value=mint" :cookie-jar jar))))
    (is (equal "mint" (nth-value 1 (http-get *server* "/test/get-cookie" :cookie-jar jar))))
    (is (equal "none" (nth-value 1 (http-get *server* "/test/get-cookie"))))))

(define-http-test http.sessions ()
  (let ((jar (make-instance 'drakma:cookie-jar)))
    (http-get *server* "/test/session-reset" :cookie-jar jar)
    (is (equal "1" (nth-value 1 (http-get *server* "/test/session" :cookie-jar jar))))
    (is (equal "2" (nth-value 1 (http-get *server* "/test/session" :cookie-jar jar))))
    (is (equal "1" (nth-value 1 (http-get *server* "/test/session"))) "a new client gets a new session")))

(define-http-test http.chunked-request-body ()
  (let ((socket (connect *server*)))
    (unwind-protect
         (progn
           (send-text socket (crlf-lines "POST /test/body HTTP/1.1" "Host: localhost"
                                         "Content-Type: application/octet-stream"
                                         "Transfer-Encoding: chunked" "Connection: close" ""
                                         "5" "hello" "7" " world!" "0" ""))
           (multiple-value-bind (status body) (read-response socket)
             (is (eql 200 status))
             (is (equal (format nil "12 ~D" (reduce #'+ (map 'list #'char-code "hello world!")))
                        body))))
      (usocket:socket-close socket))))

(define-http-test http.chunked-reply-body ()
  (multiple-value-bind (body status headers) (drakma:http-request (url *server* "/test/chunked-reply"))
    (is (eql 200 status))
    (is (equalp "chunked" (cdr (assoc :transfer-encoding headers))))
    (is (equal (format nil "~{line ~D~%~}" (loop for i below 100 collect i)) body))))

(define-http-test http.keep-alive-requests-share-a-connection ()
  (let ((socket (connect *server*))
        (ports '()))
    (unwind-protect
         (dotimes (i 3)
           (send-text socket (crlf-lines "GET /test/remote-port HTTP/1.1" "Host: localhost" ""))
           (multiple-value-bind (status body) (read-response socket)
             (is (eql 200 status))
             (push body ports)))
      (usocket:socket-close socket))
    (is (= 3 (length ports)))
    (is (= 1 (length (remove-duplicates ports :test #'equal))) "three replies on one connection")))

(define-http-test http.http-1.0 ()
  (let ((socket (connect *server*)))
    (unwind-protect
         (progn
           (send-text socket (crlf-lines "GET /test/params?v=10 HTTP/1.0" ""))
           (multiple-value-bind (status body) (read-response socket)
             (is (eql 200 status))
             (is (equal "v=10" body)))
           (is (null (read-byte (usocket:socket-stream socket) nil))
               "an HTTP/1.0 request without keep-alive closes the connection"))
      (usocket:socket-close socket))))

(define-http-test http.not-found ()
  (is (eql 404 (http-get *server* "/test/no-such-page"))))

(define-http-test http.handler-error-answers-500 ()
  (is (eql 500 (http-get *server* "/test/error")))
  (is (eql 200 (http-get *server* "/test/params")) "the server goes on serving"))

(define-http-test http.requests-in-progress-counted ()
  (is (equal '(200 "1") (multiple-value-list (http-get *server* "/test/requests-in-progress")))
      "a handler counts itself in progress")
  (is (eql 500 (http-get *server* "/test/error")))
  (is (wait-until (lambda () (zerop (requests-in-progress *server*))))
      "none in progress once answered, a failed handler's included"))

(define-http-test http.large-reply-body ()
  (multiple-value-bind (status body) (http-get *server* "/test/large" :force-binary t)
    (is (eql 200 status))
    (is (= *large-body-length* (length body)))
    (is (loop for i below (length body) always (= (aref body i) (mod i 251))))))

(define-http-test http.utf-8 ()
  (multiple-value-bind (status body)
      (http-get *server* "/test/utf-8" :parameters '(("name" . "世界")) :external-format-out :utf-8
                                       :external-format-in :utf-8)
    (is (eql 200 status))
    (is (equal "こんにちは、世界" body))))

(define-http-test http.https (:classes *https-acceptor-classes*)
  (multiple-value-bind (status body)
      (http-get *server* "/test/params?secure=yes" :verify nil)
    (is (eql 200 status))
    (is (equal "secure=yes" body)))
  (multiple-value-bind (status body)
      (http-get *server* "/test/utf-8" :verify nil :parameters '(("name" . "TLS")))
    (is (eql 200 status))
    (is (equal "こんにちは、TLS" body))))
